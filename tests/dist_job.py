"""Run under torchrun by tests/test_distributed.py: one rank of a real gloo process group.

Each rank iterates two epochs through make_loader with worker processes, checkpoints after a
few steps of epoch 1, and all ranks gather what they saw to rank 0, which writes it as JSON.
"""

import json
import sys

import torch.distributed as dist

import shardloader as sl


def main(data: str, out: str, num_workers: int) -> None:
    dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from torchrun
    ds = sl.ShardedDataset(data, batch_size=4, shuffle=True, seed=1)  # rank/world from dist
    loader = sl.make_loader(ds, num_workers=num_workers)
    seen = {}
    for epoch in range(2):
        ds.set_epoch(epoch)
        ids, pads = [], []
        for batch in loader:
            ids.append(batch["__index__"].tolist())
            pads.append(batch["__pad__"].tolist())
        seen[epoch] = {"ids": ids, "pads": pads, "len": len(loader)}
    report = ds.report(0)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(
        gathered, {"rank": dist.get_rank(), "seen": seen, "padded": report.padded_samples}
    )
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
