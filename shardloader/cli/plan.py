"""``shardloader plan``: what an epoch costs a cluster, before the job starts.

Reads only the manifest (and, with ``--classes``, the sidecars' sample keys): the plans are the
dataset's own, so the figures are what a run stages and reads.
"""

from __future__ import annotations

import json
from typing import Any

import click

from shardloader.cli.group import main
from shardloader.cli.options import storage_option, storage_options
from shardloader.errors import UsageError
from shardloader.units import human_bytes as _human

__all__ = ["plan_command"]


@main.command("plan")
@click.argument("dataset")
@click.option("--nodes", type=click.IntRange(min=1), default=1)
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=8)
@click.option(
    "--partition",
    type=click.Choice(["node", "rank", "global"]),
    default="node",
    help="node: a span of the shuffled shards per node (the default); rank: a span per rank; "
    "global: every node reads every shard.",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=32)
@click.option("--epochs", type=click.IntRange(min=1), default=1)
@click.option("--seed", type=int, default=0)
@click.option(
    "--block",
    type=click.IntRange(min=1),
    help="Shuffle block in samples (default the dataset's, 65,536).",
)
@click.option("--uneven", type=click.Choice(["pad", "drop"]), default="pad")
@click.option(
    "--classes",
    is_flag=True,
    help="Also count distinct classes per batch (class-folder datasets; reads the sidecars' "
    "sample keys).",
)
@click.option(
    "--balance",
    is_flag=True,
    help="Also predict the per-step rank cost of packed rows (--seq-len, --rows a rank), "
    "with and without PackedBatches(balance='attention') (needs recorded lengths).",
)
@click.option("--seq-len", type=click.IntRange(min=1), default=8192)
@click.option("--rows", type=click.IntRange(min=1), default=1)
@click.option("--balance-c", type=click.FloatRange(min=0), default=0.0)
@click.option(
    "--stage",
    "stages",
    multiple=True,
    metavar="STEP:NAME=W,...",
    help="A mixture stage (repeat; the first at step 0): DATASET then names the sources, "
    "name=url,name=url; prints where each stage begins and what it delivers per source.",
)
@click.option(
    "--epoch-samples",
    type=click.IntRange(min=1),
    help="With --stage: documents of a mixture epoch (default all sources').",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@storage_option
def plan_command(dataset: str, **flags: Any) -> None:
    """Per node: the shards and bytes an epoch stages, its GETs, the cluster's bytes as a
    multiple of the dataset, the node cache a node needs, and how well the epoch mixes."""
    from shardloader.manifest import load_manifest
    from shardloader.plan.cost import epoch_cost, shuffle_quality
    from shardloader.plan.epoch import EpochPlanner
    from shardloader.plan.partition import choose_partition
    from shardloader.plan.shuffle import ShuffleOptions
    from shardloader.storage.store import as_store

    nodes, per_node, batch_size = flags["nodes"], flags["ranks_per_node"], flags["batch_size"]
    as_json = flags["as_json"]
    if flags["stages"]:  # a staged mixture: cli/stageplan.py
        from shardloader.cli.stageplan import stage_figures, stage_text

        figures = stage_figures(dataset, flags)
        head = f"{dataset}: {nodes} node(s) x {per_node} ranks, batch {batch_size} a rank"
        click.echo(
            json.dumps(figures, indent=1) if as_json else "\n".join([head, *stage_text(figures)])
        )
        return
    storage = storage_options(flags["storage_option"])
    manifest, base = load_manifest(as_store(dataset, storage, None))
    if manifest.num_samples == 0:
        raise UsageError(f"{dataset} holds no samples")
    block = flags["block"]
    shuffle = ShuffleOptions(True) if block is None else ShuffleOptions(True, block=block)
    planning = EpochPlanner(
        manifest.shard_sizes, flags["seed"], shuffle, flags["uneven"], batch_size
    )
    part = choose_partition(flags["partition"], nodes * per_node, per_node, manifest.num_samples)
    labels = _labels(manifest, base) if flags["classes"] else None
    epochs_out: list[dict[str, Any]] = []
    previous = None
    for epoch in range(flags["epochs"]):
        cost, previous = epoch_cost(manifest, planning, epoch, part, per_node, previous)
        quality = shuffle_quality(planning, epoch, part, labels)
        epochs_out.append(_epoch_dict(cost, quality, epoch > 0))
    out = {
        "dataset": dataset,
        "shards": len(manifest.shards),
        "samples": manifest.num_samples,
        "stored_bytes": sum(s.bytes for s in manifest.shards),
        "nodes": nodes,
        "ranks_per_node": per_node,
        "partition": flags["partition"],
        "partitions": part.nodes,
        "batch_size": batch_size,
        "shuffle_block": shuffle.block,
        "epochs": epochs_out,
    }
    if flags["balance"]:
        from shardloader.cli.balanceplan import balance_figures

        out["balance"] = balance_figures(manifest, base, planning, part, flags)
    click.echo(json.dumps(out, indent=1) if as_json else _text(out))


def _labels(manifest: Any, base: Any) -> Any:
    """Each sample's class from its key (class folders: ``class/name``), by global id."""
    import numpy as np

    from shardloader.read.sidecar import load_sidecar

    if manifest.layout != "class-folders":
        raise UsageError(
            f"--classes needs a class-folder dataset; this one's layout is {manifest.layout!r}"
        )
    names = {c: i for i, c in enumerate(manifest.classes)}
    out: list[int] = []
    for shard in manifest.shards:
        index = load_sidecar(base.join(shard.index_path), manifest.format, shard)
        out += [names.get(k.split("/", 1)[0], -1) for k in index.keys]
    return np.asarray(out, np.int64)


def _epoch_dict(cost: Any, quality: Any, repeat: bool) -> dict[str, Any]:
    per = cost.nodes
    shards, stored = [n.shards for n in per], [n.stored_bytes for n in per]
    out: dict[str, Any] = {
        "epoch": cost.epoch,
        "shards_per_node": {"min": min(shards), "max": max(shards)},
        "stored_bytes_per_node": {"min": min(stored), "max": max(stored)},
        "gets": cost.gets,
        "cluster_bytes": cost.cluster_bytes,
        "cluster_multiple": round(cost.multiple, 4),
        "node_cache_share_bytes": cost.share_bytes,
        "node_cache_working_set_bytes": cost.working_set,
        "quality": {
            "shards_per_global_batch": round(quality.shards_per_global_batch, 2),
            "shards_per_rank_batch": round(quality.shards_per_rank_batch, 2),
            "kendall_tau": round(quality.kendall_tau, 4),
        },
        "per_node": [
            {"node": n.node, "shards": n.shards, "stored_bytes": n.stored_bytes} for n in per
        ],
    }
    if quality.classes_per_global_batch is not None:
        out["quality"]["classes_per_global_batch"] = round(quality.classes_per_global_batch, 2)
        out["quality"]["classes_per_rank_batch"] = round(quality.classes_per_rank_batch, 2)
    if repeat:
        out["gets_with_share_cache"] = sum(n.shards - n.kept_shards for n in per)
    return out


def _text(out: dict[str, Any]) -> str:
    lines = [
        f"{out['dataset']}: {out['shards']:,} shards, {out['samples']:,} samples, "
        f"{_human(out['stored_bytes'])} stored",
        f"  {out['nodes']} node(s) x {out['ranks_per_node']} ranks, partition "
        f"{out['partition']} ({out['partitions']} partition(s)), batch {out['batch_size']} a "
        f"rank, shuffle block {out['shuffle_block']:,} samples",
    ]
    for e in out["epochs"]:
        s, b, q = e["shards_per_node"], e["stored_bytes_per_node"], e["quality"]
        lines += [
            f"  epoch {e['epoch']}:",
            f"    per node      {s['min']:,}-{s['max']:,} shards, "
            f"{_human(b['min'])}-{_human(b['max'])} to stage, one GET a shard",
            f"    cluster       {e['gets']:,} GETs, {_human(e['cluster_bytes'])} = "
            f"{e['cluster_multiple']:.3f}x the dataset",
            f"    node cache    {_human(e['node_cache_share_bytes'])} holds a node's share "
            f"for the epoch; at least {_human(e['node_cache_working_set_bytes'])} to stream it",
        ]
        if "gets_with_share_cache" in e:
            lines.append(
                f"    with a cache holding the share since the last epoch: "
                f"{e['gets_with_share_cache']:,} GETs"
            )
        mix = (
            f"    mixing        {q['shards_per_global_batch']:.1f} shards a global batch, "
            f"{q['shards_per_rank_batch']:.1f} a rank batch, Kendall tau {q['kendall_tau']:+.3f}"
        )
        if "classes_per_global_batch" in q:
            mix += (
                f"; {q['classes_per_global_batch']:.1f} classes a global batch, "
                f"{q['classes_per_rank_batch']:.1f} a rank batch"
            )
        lines.append(mix)
    if "balance" in out:
        from shardloader.cli.balanceplan import balance_text

        lines += balance_text(out["balance"])
    return "\n".join(lines)
