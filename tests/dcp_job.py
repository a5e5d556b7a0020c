"""Run by tests/test_stack_dist.py under torchrun, 2 ranks: DCP at another world size.

Loads the checkpoint tests/stack_job.py saved from 4 ranks (2 replicas x 2) into a plain
2-rank loader, reads 2 steps, saves through DCP again, loads that into a fresh loader and
reads the rest of the epoch.  Rank 0 writes what every rank saw and the states as JSON.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from stack_job import make, record, take

import shardloader as sl


def main(data, out, ckpt):
    dist.init_process_group("gloo")
    ds = make(data)  # rank and world from torch.distributed: 2 ranks
    # forkserver, not fork: dcp.load has just run, and CPython 3.11 can deadlock a child forked
    # while another thread holds the interpreter's thread-state lock (seen once in CI: the
    # worker hung in PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept)
    loader = sl.make_loader(ds, num_workers=1, multiprocessing_context="forkserver")
    target = {"model": {"weight": torch.zeros(6)}, "dataloader": loader}
    dcp.load(target, checkpoint_id=os.path.join(ckpt, "a"))
    mine = {"rank": dist.get_rank(), "loaded": loader.state_dict()}
    ds.set_epoch(1)
    mine["part"] = record(take(loader, 2))
    dcp.save({"dataloader": loader}, checkpoint_id=os.path.join(ckpt, "b"))
    mine["saved"] = loader.state_dict()
    fresh = make(data)
    again = sl.make_loader(fresh, num_workers=0)
    dcp.load({"dataloader": again}, checkpoint_id=os.path.join(ckpt, "b"))
    mine["reloaded"] = again.state_dict()
    fresh.set_epoch(1)
    mine["rest"] = record(list(again))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
