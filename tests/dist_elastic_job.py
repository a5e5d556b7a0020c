"""Run under torchrun by tests/test_elastic_resume.py: one rank of a real gloo process group.

``DATA MODE SHAPE STATE OUT``: with no STATE file yet, the ranks read 3 steps of epoch 1 with
batch shape SHAPE (``fixed``: batch_size; ``packed``: rows_per_batch) and rank 0 saves the
loader state; with one, they resume from it at SHAPE and read the rest of the epoch.  Every
rank sends what it saw (segments ``(id, start, stop, pad)``) to rank 0, which writes JSON.
"""

import json
import os
import sys

import torch.distributed as dist

import shardloader as sl
from shardloader.batching import PackedBatches


def spans(samples):
    return [(int(s["__index__"]), *s.get("__span__", (0, 0)), bool(s["__pad__"])) for s in samples]


def main(data: str, mode: str, shape: int, state_file: str, out: str) -> None:
    dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from torchrun
    kw = dict(shuffle=True, seed=7, collate_fn=spans)
    if mode == "fixed":
        ds = sl.ShardedDataset(data, batch_size=shape, **kw)
    else:
        planner = PackedBatches(seq_len=64, rows_per_batch=shape, window=16, fit="best")
        ds = sl.ShardedDataset(data, planner=planner, **kw)
    loader = sl.make_loader(ds, num_workers=2)
    resuming = os.path.exists(state_file)
    dist.barrier()  # every rank has looked before rank 0 writes the state (a slow rank resumed)
    if resuming:
        with open(state_file) as f:
            loader.load_state_dict(json.load(f))
    ds.set_epoch(1)
    planned = len(loader)  # steps of this pass (after it, the epoch starts afresh)
    seen = []
    for batch in loader:
        seen.append(batch)
        if not resuming and len(seen) == 3:
            break
    if not resuming and dist.get_rank() == 0:
        with open(state_file, "w") as f:
            json.dump(loader.state_dict(), f)
    lengths = {}
    if resuming and dist.get_rank() == 0:
        whole = sl.ShardedDataset(data, decoder=None, world=sl.World(0, 1))
        lengths = {int(s["__index__"]): len(s["bin"]) for s in whole}
    gathered = [None] * dist.get_world_size()
    mine = {"rank": dist.get_rank(), "segments": seen, "len": planned, "lengths": lengths}
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        gathered[0]["lengths"] = lengths
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
