"""``shardloader plan SOURCES --stage STEP:WEIGHTS ...``: where a staged mixture's stages begin
and what each delivers per source (NOTE [stages] in :mod:`shardloader.plan.stages`).

Builds the :class:`~shardloader.mixture.Mixture` a run would (same sources, stages, batch size,
world and seed), so the boundaries and counts are the run's own; reads the manifests and the
recorded lengths, no shard.
"""

from __future__ import annotations

from typing import Any

from shardloader.cli.options import storage_options
from shardloader.errors import UsageError

__all__ = ["parse_sources", "parse_stage", "stage_figures", "stage_text"]


def _pairs(text: str) -> dict[str, str]:
    """``a=x,b=y`` as ``{"a": "x", "b": "y"}``; ValueError naming the bad item."""
    out: dict[str, str] = {}
    for item in text.split(","):
        name, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not name or not value or name in out:
            raise ValueError(item)
        out[name] = value
    return out


def parse_sources(text: str) -> dict[str, str]:
    """``web=packed-text/,code=s3://b/code/`` as ``{name: url}``."""
    try:
        return _pairs(text)
    except ValueError as err:
        raise UsageError(
            f"with --stage, DATASET names the mixture's sources once each as "
            f"name=url,name=url; got {text!r} (at {str(err)!r})"
        ) from None


def parse_stage(text: str) -> tuple[int, dict[str, float]]:
    """``30:web=0.5,code=0.5`` as ``(30, {"web": 0.5, "code": 0.5})``."""
    step, colon, rest = text.partition(":")
    try:
        if not colon:
            raise ValueError(text)
        return int(step), {name: float(value) for name, value in _pairs(rest).items()}
    except ValueError as err:
        raise UsageError(
            f"--stage {text!r} is not STEP:name=weight,name=weight (e.g. 0:web=0.9,code=0.1)"
        ) from err


def stage_figures(sources: str, flags: dict[str, Any]) -> dict[str, Any]:
    """The stages of the mixture a run of ``nodes x ranks_per_node`` ranks x ``batch_size``
    would read (``flags``: the plan command's options; several node partitions are refused,
    as the run refuses them)."""
    from shardloader.mixture import Mixture
    from shardloader.options import ReadOptions, World

    storage = storage_options(flags["storage_option"])
    nodes, per_node = flags["nodes"], flags["ranks_per_node"]
    mix = Mixture(
        parse_sources(sources),
        stages=[parse_stage(s) for s in flags["stages"]],
        batch_size=flags["batch_size"],
        epoch_samples=flags["epoch_samples"],
        shuffle=True,
        seed=flags["seed"],
        uneven=flags["uneven"],
        read=ReadOptions(storage_options=storage) if storage else None,
        world=World(partition=flags["partition"]),
    ).for_rank(0, nodes * per_node, per_node)
    mix.stage_starts()  # several node partitions: refused here, as in the run
    return {
        "sources": list(mix.names),
        "epoch_samples": mix.epoch_samples,
        "samples_per_step": mix.samples_per_step,
        "epochs": flags["epochs"],
        "stages": mix.stage_report(flags["epochs"]),
    }


def stage_text(out: dict[str, Any]) -> list[str]:
    lines = [
        f"  stages: {out['samples_per_step']:,} documents a step, "
        f"{out['epoch_samples']:,} a mixture epoch; counts up to the end of epoch "
        f"{out['epochs'] - 1}"
    ]
    for st in out["stages"]:
        lines.append(
            f"    from step {st['step']:,} (epoch {st['epoch']}, position {st['position']:,}), "
            f"{st['positions']:,} documents:"
        )
        for name, got in st["sources"].items():
            tokens = "" if got["tokens"] is None else f", {got['tokens']:,} tokens"
            lines.append(
                f"      {name:<12} weight {st['weights'][name]:.3f}: "
                f"{got['samples']:,} documents{tokens}"
            )
    return lines
