"""Run under torchrun by tests/test_mixture_stages.py: one rank of a real gloo process group
reading a staged three-source Mixture through 2 DataLoader workers.

``stages_job.py A B C OUT STOP STATE BATCH``: reads mixture epochs 0 and 1 in batches of BATCH
per rank, from the saved state in STATE if the file exists, stops after STOP steps (-1: both
epochs), then saves the loader state to STATE and gathers every rank's batches (ids) to rank 0,
which writes OUT.
"""

import json
import os
import sys

import torch.distributed as dist

import shardloader as sl

STAGES = [(0, {"a": 3, "b": 1, "c": 0}), (7, {"a": 1, "b": 1, "c": 2})]


def main(a: str, b: str, c: str, out: str, stop: int, state_path: str, batch: int) -> None:
    dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from torchrun
    mix = sl.Mixture(
        {"a": a, "b": b, "c": c},
        stages=STAGES,
        batch_size=batch,
        epoch_samples=60,
        shuffle=True,
        seed=6,
        collate_fn=list,
    )
    loader = sl.make_loader(mix, num_workers=2)
    first = 0
    if os.path.exists(state_path):
        with open(state_path) as f:
            loader.load_state_dict(json.load(f))
        first = mix.epoch
    batches: list[list[int]] = []
    for epoch in range(first, 2):
        if epoch != first:
            mix.set_epoch(epoch)
        for got in loader:
            batches.append([int(s["__index__"]) for s in got if not s["__pad__"]])
            if len(batches) == stop:
                break
        if len(batches) == stop:
            break
    state = loader.state_dict()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "batches": batches})
    if dist.get_rank() == 0:
        with open(state_path, "w") as f:
            json.dump(state, f)
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5], int(sys.argv[5]), sys.argv[6], int(sys.argv[7]))
