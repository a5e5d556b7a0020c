"""What an epoch costs a cluster and how well it mixes: shardloader's partitions against
MosaicML streaming's, on a simulated world (pure planning over synthetic manifests: no data).

One command, in a venv with ``mosaicml-streaming`` (``/work/main/.venv-bench`` has it; without
it the peer columns are skipped)::

    PYTHONPATH=. /work/main/.venv-bench/bin/python tools/bench_locality.py [--json out.json]

It prints, for each corpus and world (nodes x 8 ranks, batch 16 a rank):

* cost: shards each node stages per epoch, the cluster's bytes as a multiple of the dataset,
  and a node's staged bytes as a share of ``1 / nodes`` of the dataset — shardloader with node
  partitions (the default), with the global order, and MosaicML ``py1e`` (canonical nodes =
  nodes, its default shuffle block), every node's shards read off the sample ids it is given;
* mixing: distinct shards in a global batch and in a rank batch, Kendall's tau between pack
  order and the order the cluster consumes samples in, distinct classes in a global and a rank
  batch (classes contiguous in pack order, as a class-folder pack writes them) — shardloader
  and MosaicML ``py1e`` / ``py1br`` at its default block and at shardloader's;
* elastic: a state saved at 8 nodes x 8 ranks, 30 % into an epoch, resumed on 6 x 8, 4 x 8,
  16 x 8 and 8 x 4 ranks with the global batch kept: every remaining sample once, and the
  shards the new world reads as a multiple of what remains (MosaicML resumes only where its
  canonical nodes divide the new node count).

Pure planning, single process: the figures do not depend on the machine's load (the elapsed
seconds printed do).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardloader.manifest import FieldInfo, Manifest, ShardInfo  # noqa: E402
from shardloader.plan.cost import epoch_cost, kendall_tau, shuffle_quality  # noqa: E402
from shardloader.plan.epoch import EpochPlanner  # noqa: E402
from shardloader.plan.partition import Partition  # noqa: E402
from shardloader.plan.shuffle import ShuffleOptions  # noqa: E402

RANKS, BATCH = 8, 16
SAMPLE_BYTES = 10_000  # synthetic: every sample this big, compressed 1:1


def manifest_of(sizes: list[int]) -> Manifest:
    shards = [
        ShardInfo(
            f"s-{i:05d}.tar",
            n,
            n * SAMPLE_BYTES,
            n * SAMPLE_BYTES,
            "0" * 64,
            f"s-{i}.idx",
            "0" * 64,
        )
        for i, n in enumerate(sizes)
    ]
    return Manifest("tar", "none", {"bin": FieldInfo("bytes")}, shards)


# ------------------------------------------------------------------------------- MosaicML


def mosaic_epoch(
    sizes: np.ndarray,
    nodes: int,
    algo: str,
    block: int,
    epoch: int = 0,
    drop_first: int = 0,
    canonical: int | None = None,
    physical: int | None = None,
    ranks: int = RANKS,
    batch: int = BATCH,
) -> np.ndarray | None:
    """MosaicML's sample ids ``[nodes, ranks, batches, batch]`` for one epoch (one worker a
    rank), as ``StreamingDataset`` draws them; None without streaming installed."""
    try:
        from streaming.base.partition import get_partitions
        from streaming.base.shuffle import get_shuffle
    except ImportError:
        return None
    canonical = canonical or nodes
    physical = physical or nodes
    ids = get_partitions("orig", int(sizes.sum()), canonical, physical, ranks, 1, batch, drop_first)
    shuffle = get_shuffle(algo, sizes, canonical, 0, epoch, block)
    ids = np.where(ids != -1, shuffle[ids], -1)
    return ids[:, :, 0]  # [nodes, ranks, batches, batch]


def mosaic_cost(sizes: np.ndarray, ids: np.ndarray) -> dict[str, float]:
    starts = np.concatenate([[0], np.cumsum(sizes)])
    per_node = []
    for node in ids:
        flat = node[node >= 0]
        per_node.append(len(np.unique(np.searchsorted(starts, flat, side="right") - 1)))
    return _cost_figures(per_node, sizes, ids.shape[0])


def mosaic_quality(sizes: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    starts = np.concatenate([[0], np.cumsum(sizes)])
    steps = ids.shape[2]
    picked = np.unique(np.linspace(0, steps - 1, min(64, steps)).astype(np.int64))
    g_shards, r_shards, g_cls, r_cls, seq = [], [], [], [], []
    for t in picked.tolist():
        batch = ids[:, :, t, :]  # [nodes, ranks, batch]
        flat = batch[batch >= 0]
        shard = np.searchsorted(starts, flat, side="right") - 1
        g_shards.append(len(np.unique(shard)))
        g_cls.append(len(np.unique(labels[flat])))
        for rank_batch in batch.reshape(-1, batch.shape[-1]):
            ok = rank_batch[rank_batch >= 0]
            r_shards.append(len(np.unique(np.searchsorted(starts, ok, side="right") - 1)))
            r_cls.append(len(np.unique(labels[ok])))
        seq.append(flat)
    order = np.concatenate(seq)
    if order.size > 20_000:
        order = order[np.linspace(0, order.size - 1, 20_000).astype(np.int64)]
    return {
        "shards_per_global_batch": float(np.mean(g_shards)),
        "shards_per_rank_batch": float(np.mean(r_shards)),
        "kendall_tau": kendall_tau(order),
        "classes_per_global_batch": float(np.mean(g_cls)),
        "classes_per_rank_batch": float(np.mean(r_cls)),
    }


# ------------------------------------------------------------------------------ shardloader


def _cost_figures(per_node: list[int], sizes: np.ndarray, nodes: int) -> dict[str, float]:
    shards = len(sizes)
    return {
        "shards_per_node_max": max(per_node),
        "cluster_multiple": sum(per_node) / shards,
        "node_share_vs_1_over_n": max(per_node) / (shards / nodes),
    }


def ours_cost(manifest: Manifest, nodes: int, partition: str) -> dict[str, float]:
    planning = EpochPlanner(manifest.shard_sizes, 0, ShuffleOptions(True), "pad", BATCH)
    part = Partition(nodes, RANKS) if partition == "node" else Partition(1, nodes * RANKS)
    cost, _ = epoch_cost(manifest, planning, 0, part, RANKS)
    return {
        "shards_per_node_max": max(n.shards for n in cost.nodes),
        "cluster_multiple": cost.multiple,
        "node_share_vs_1_over_n": max(n.stored_bytes for n in cost.nodes)
        / (cost.dataset_bytes / nodes),
    }


def ours_quality(
    manifest: Manifest, nodes: int, labels: np.ndarray, block: int = 1 << 16
) -> dict[str, float]:
    shuffle = ShuffleOptions(True, block=block)
    planning = EpochPlanner(manifest.shard_sizes, 0, shuffle, "pad", BATCH)
    q = shuffle_quality(planning, 0, Partition(nodes, RANKS), labels)
    return {k: float(v) for k, v in q.__dict__.items()}


def ours_elastic(sizes: list[int], after: tuple[int, int], share: float = 0.3) -> dict[str, Any]:
    """A state at 8 x 8 ``share`` into epoch 1, resumed on ``after`` with the global batch
    kept: remaining samples delivered once, shard reads over what remains."""
    before_world, global_batch = 64, 64 * BATCH
    planning = EpochPlanner(np.asarray(sizes), 0, ShuffleOptions(True), "pad", BATCH)
    steps = int(share * planning.plan(1, 0, 0, 64, None, (), Partition(8, 8)).slots.steps_per_rank)
    consumed = steps * before_world
    history = ((BATCH, 8, consumed),)
    nodes, ranks = after
    batch = global_batch // (nodes * ranks)
    planning2 = EpochPlanner(np.asarray(sizes), 0, ShuffleOptions(True), "pad", batch)
    plans = planning2.cluster(1, 0, Partition(nodes, ranks), None, history)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    first = planning.cluster(1, 0, Partition(8, 8), None)
    delivered = []
    for plan in first:  # what the 8 x 8 run delivered before its state
        for local in range(8):
            slots = plan.slots.of_rank(local)
            delivered += [np.asarray(plan.batches[slots.slot_of(j)]) for j in range(steps)]
    done = np.concatenate(delivered)
    rest_ids, reads = [], 0
    for plan in plans:  # a node stages each shard any of its batches touches, once
        ids = np.concatenate([np.asarray(b) for b in plan.batches])
        reads += len(np.unique(np.searchsorted(starts, ids, side="right") - 1))
        rest_ids.append(ids[: ids.size - plan.pad_in_last])  # without the last batch's filling
    counts = np.bincount(np.concatenate([done, *rest_ids]), minlength=int(sum(sizes)))
    remaining_shards = (int(sum(sizes)) - done.size) / (sum(sizes) / len(sizes))
    return {
        "after": f"{nodes}x{ranks}",
        "batch": batch,
        "global_batch_kept": batch * nodes * ranks == global_batch,
        "every_sample_once": bool((counts == 1).all()),
        "reads_over_remaining": reads / remaining_shards,
    }


def mosaic_elastic_possible(after: tuple[int, int]) -> bool:
    nodes, _ = after
    return 8 % nodes == 0 or nodes % 8 == 0


# ------------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--quick", action="store_true", help="smaller worlds (a smoke run)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out: dict[str, Any] = {"cost": [], "quality": [], "elastic": []}
    corpora = {
        "100k samples / 200 shards": [500] * 200,
        "10M samples / 10,000 shards": [1000] * 10_000,
    }
    worlds = [1, 4, 16] if args.quick else [1, 4, 16, 64, 512]
    print(f"cost per epoch, nodes x {RANKS} ranks, batch {BATCH} a rank")
    print(
        f"{'corpus':30} {'nodes':>5} {'system':22} {'shards/node':>11} {'cluster x':>9} "
        f"{'node share x 1/N':>16}"
    )
    for name, sizes in corpora.items():
        m = manifest_of(sizes)
        arr = np.asarray(sizes, np.int64)
        for nodes in worlds:
            if nodes * RANKS > len(sizes) * 4 and name.startswith("100k") and nodes > 64:
                continue
            rows = [("shardloader node", ours_cost(m, nodes, "node"))]
            if nodes <= 64:
                rows.append(("shardloader global", ours_cost(m, nodes, "global")))
            ids = mosaic_epoch(arr, nodes, "py1e", max(4_000_000 // nodes, 1 << 18))
            if ids is not None:
                rows.append(("mosaic py1e", mosaic_cost(arr, ids)))
            for system, fig in rows:
                print(
                    f"{name:30} {nodes:>5} {system:22} {fig['shards_per_node_max']:>11,} "
                    f"{fig['cluster_multiple']:>9.3f} {fig['node_share_vs_1_over_n']:>16.3f}"
                )
                out["cost"].append({"corpus": name, "nodes": nodes, "system": system, **fig})
    print(f"\nmixing, nodes x {RANKS} ranks, batch {BATCH}; 1,000 classes in pack order")
    head = ("shards/global", "shards/rank", "tau", "classes/global", "classes/rank")
    print(f"{'corpus':30} {'nodes':>5} {'system':26} " + " ".join(f"{h:>14}" for h in head))
    for name, sizes in corpora.items():
        m = manifest_of(sizes)
        arr = np.asarray(sizes, np.int64)
        labels = np.arange(int(arr.sum())) * 1000 // int(arr.sum())
        for nodes in [n for n in worlds if n <= 64]:
            mosaic_block = max(4_000_000 // nodes, 1 << 18)
            rows = [
                ("shardloader node", ours_quality(m, nodes, labels)),
                ("shardloader block default*", ours_quality(m, nodes, labels, mosaic_block)),
            ]
            for algo in ("py1e", "py1br"):
                for block, tag in ((max(4_000_000 // nodes, 1 << 18), "default"), (1 << 16, "64k")):
                    ids = mosaic_epoch(arr, nodes, algo, block)
                    if ids is not None:
                        rows.append(
                            (f"mosaic {algo} block {tag}", mosaic_quality(arr, ids, labels))
                        )
            for system, q in rows:
                cells = [
                    q["shards_per_global_batch"],
                    q["shards_per_rank_batch"],
                    q["kendall_tau"],
                    q["classes_per_global_batch"],
                    q["classes_per_rank_batch"],
                ]
                print(f"{name:30} {nodes:>5} {system:26} " + " ".join(f"{c:>14.3f}" for c in cells))
                out["quality"].append({"corpus": name, "nodes": nodes, "system": system, **q})
    print("(* shardloader with MosaicML's default shuffle block, max(4M / nodes, 256k) samples)")
    print("\nelastic: a state at 8 x 8, 30 % into an epoch (10M samples / 10,000 shards)")
    sizes = [1000] * (1000 if args.quick else 10_000)
    for after in ((6, 8), (4, 8), (16, 8), (8, 4)):
        e = ours_elastic(sizes, after)
        e["mosaic_can_resume"] = mosaic_elastic_possible(after)
        print(
            f"  {e['after']:>5}: batch {e['batch']:>3} (global kept: {e['global_batch_kept']}), "
            f"every sample once: {e['every_sample_once']}, "
            f"shard reads / remaining {e['reads_over_remaining']:.3f}; "
            f"MosaicML can resume: {e['mosaic_can_resume']}"
        )
        out["elastic"].append(e)
    out["seconds"] = time.perf_counter() - t0
    print(f"\n{out['seconds']:.1f} s (pure planning; load {os.getloadavg()[0]:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
