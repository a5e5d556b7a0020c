"""Run under torchrun by tests/test_balance.py: one rank of a real gloo process group reading
balanced packed batches (``PackedBatches(balance="attention", ranks=world)``).

Each rank iterates an epoch through make_loader with worker processes; all ranks gather the
segments they read per step to rank 0, which writes them as JSON.
"""

import json
import sys

import torch.distributed as dist

import shardloader as sl
from shardloader.batching import PackedBatches


def main(data: str, out: str, num_workers: int, seq_len: int, rows: int, pad: int) -> None:
    dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from torchrun
    world = dist.get_world_size()
    planner = PackedBatches(seq_len, rows, window=16, pad_id=pad, balance="attention", ranks=world)
    ds = sl.ShardedDataset(data, planner=planner, shuffle=True, seed=3)  # rank/world from dist
    loader = sl.make_loader(ds, num_workers=num_workers)
    steps = []
    for batch in loader:
        steps.append(
            [
                [k, int(a), int(b), bool(p)]
                for k, (a, b), p in zip(
                    batch["__key__"], batch["__span__"], batch["__pad__"], strict=True
                )
            ]
        )
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "steps": steps})
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7]))
