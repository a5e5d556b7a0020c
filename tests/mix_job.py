"""Run under torchrun by tests/test_mixture_dist.py: one rank of a real gloo process group
reading a two-source Mixture with sequence packing through DataLoader workers.

``mix_job.py WEB CODE OUT STOP STATE ROWS``: reads epoch 0 in batches of ROWS packed rows per
rank from the saved state in STATE (if the file exists; a different ROWS re-cuts the rest of the
epoch), stops after STOP steps (-1: the whole pass), then saves the loader state to
STATE and gathers every rank's segments (id, start, stop) to rank 0, which writes OUT
(segments as (id, start, stop, padding)).
"""

import json
import os
import sys

import torch.distributed as dist

import shardloader as sl
from shardloader.batching import PackedBatches


def main(web: str, code: str, out: str, stop: int, state_path: str, rows: int) -> None:
    dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from torchrun
    pad = int(sl.read_manifest(web)[0].extra["tokenizer"]["vocab_size"])
    planner = PackedBatches(seq_len=16, rows_per_batch=rows, window=8, pad_id=pad)
    mix = sl.Mixture(
        {"web": web, "code": code},
        {"web": 0.7, "code": 0.3},
        planner=planner,
        shuffle=True,
        seed=3,
        epoch_samples=50,
    )
    loader = sl.make_loader(mix, num_workers=2)
    if os.path.exists(state_path):
        with open(state_path) as f:
            loader.load_state_dict(json.load(f))
    segments = []
    for step, batch in enumerate(loader):
        segments += [
            [int(i), int(a), int(b), bool(p)]
            for i, (a, b), p in zip(
                batch["__index__"], batch["__span__"], batch["__pad__"], strict=True
            )
        ]
        if step + 1 == stop:
            break
    state = loader.state_dict()
    gathered = [None] * dist.get_world_size()
    info = {"rank": dist.get_rank(), "segments": segments, "steps": len(loader), "state": state}
    dist.all_gather_object(gathered, info)
    if dist.get_rank() == 0:
        with open(state_path, "w") as f:
            json.dump(state, f)
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
