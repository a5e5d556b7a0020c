"""Run by tests/test_stack_dist.py under two torchrun "nodes" of 2 ranks: one rank of a real
gloo job laid out as meshes of data-parallel replicas.

1. A whole epoch at 2 replicas x 2 tensor-parallel ranks (the mesh's "dp" dimension), with 0
   and 2 DataLoader workers.
2. Epoch 1 at 2 x 2, stopped after 3 steps, saved through DCP next to a model tensor, loaded
   through DCP into a loader at 4 x 1, which reads the rest.
3. Epoch 2 at 4 x 1, stopped after 2 steps, its state loaded at 2 x 2 (make_loader's kwarg).

Rank 0 writes what every rank saw (ids, pads, a digest per batch, places, states) as JSON.
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import shardloader as sl


def make(data, **kw):
    cache = sl.CacheOptions(dir=os.environ["NODE_CACHE"])
    return sl.ShardedDataset(
        data, batch_size=4, shuffle=True, seed=5, read=sl.ReadOptions(cache=cache), **kw
    )


def record(batches):
    return {
        "ids": [b["__index__"].tolist() for b in batches],
        "pads": [b["__pad__"].tolist() for b in batches],
        "digests": [hashlib.sha256(b"".join(b["bin"])).hexdigest() for b in batches],
    }


def take(loader, steps):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == steps:
            break
    return out


def main(data, out, ckpt):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    mine = {"rank": rank, "coord": mesh.get_coordinate()}

    for workers in (0, 2):  # 1. a replica's ranks: the same batches at any num_workers
        ds = make(data, world=sl.World.of(mesh))  # the whole mesh: its "dp" dimension
        loader = sl.make_loader(ds, num_workers=workers)
        mine[f"epoch0_w{workers}"] = {
            **record(list(loader)),
            "len": len(loader),
            "place": [ds.rank, ds.world_size],
            "partition": [ds.partition.nodes, ds.partition.ranks],
        }

    ds = make(data)  # 2. 2 x 2 -> DCP -> 4 x 1
    ds.set_world(sl.World.of(mesh["dp"]))  # a place given after the dataset was made
    loader = sl.make_loader(ds, num_workers=1)
    ds.set_epoch(1)
    head = take(loader, 3)
    model = {"weight": torch.arange(6.0)}
    dcp.save({"model": model, "dataloader": loader}, checkpoint_id=os.path.join(ckpt, "a"))
    fresh = make(data, world=sl.World.of(flat))
    again = sl.make_loader(fresh, num_workers=2)
    loaded = {"model": {"weight": torch.zeros(6)}, "dataloader": again}
    dcp.load(loaded, checkpoint_id=os.path.join(ckpt, "a"))
    mine["dcp"] = {
        "head": record(head),
        "saved": loader.state_dict(),
        "loaded": again.state_dict(),
        "weight": loaded["model"]["weight"].tolist(),
        "partition": [fresh.partition.nodes, fresh.partition.ranks],
    }
    fresh.set_epoch(1)
    mine["dcp"]["rest"] = record(list(again))

    ds = make(data, world=sl.World.of(flat))  # 3. 4 x 1 -> 2 x 2
    loader = sl.make_loader(ds, num_workers=2)
    ds.set_epoch(2)
    head = take(loader, 2)
    state = loader.state_dict()
    replica = make(data)
    replica.set_world(sl.World.of(mesh))
    again = sl.make_loader(replica, num_workers=2)
    again.load_state_dict(state)
    replica.set_epoch(2)
    mine["grow"] = {"head": record(head), "state": state, "rest": record(list(again))}

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
