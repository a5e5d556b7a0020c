"""Run under two torchrun "nodes" by tests/test_distributed.py: one rank of a real gloo group.

Each node stages into its own cache folder (``NODE_CACHE``), as two machines would; every rank
reads one epoch through make_loader with a worker, and rank 0 writes what every rank saw, the
partition it planned in and the shard copies each node's cache holds.
"""

import json
import os
import sys

import torch.distributed as dist

import shardloader as sl


def staged(cache: str) -> list[str]:
    names = set()
    for _, _, files in os.walk(cache):
        names |= {f.split(".")[0] for f in files if "shard-" in f and not f.endswith(".lock")}
    return sorted(names)


def main(data: str, out: str, partition: str) -> None:
    dist.init_process_group("gloo")
    cache = sl.CacheOptions(dir=os.environ["NODE_CACHE"])
    ds = sl.ShardedDataset(
        data,
        batch_size=4,
        shuffle=True,
        seed=3,
        read=sl.ReadOptions(cache=cache),
        world=sl.World(partition=partition),
    )
    loader = sl.make_loader(ds, num_workers=1)
    ids, pads = [], []
    for batch in loader:
        ids.append(batch["__index__"].tolist())
        pads.append(batch["__pad__"].tolist())
    dist.barrier()  # every rank of the node has staged what it needs
    mine = {
        "rank": dist.get_rank(),
        "partition": [ds.partition.nodes, ds.partition.ranks],
        "ids": ids,
        "pads": pads,
        "staged": staged(os.environ["NODE_CACHE"]),
        "node": int(os.environ["GROUP_RANK"]),
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
