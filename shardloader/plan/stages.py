"""Mixture stages: weights that change at optimizer steps (``Mixture(..., stages=...)``).

NOTE [stages]: ``stages=[(step, weights), ...]`` change the weights at global optimizer steps,
mid-epoch too.  A step of fixed batches holds ``batch_size x world size`` positions of the
mixed stream (steps counted across mixture epochs as the loader counts them), so each stage
begins at a fixed stream position and the blend (:class:`~shardloader.plan.blend.MixOrder`)
starts a fresh segment there.  The first saved state fixes that step size: a resume on another
world size or worker count keeps every stage at the same stream position, so the continuation
equals an unbroken run (and begins each stage at the same step when the global batch is kept,
as an elastic resume does).  The stages are in the plan signature and the state; a resume with
other stages is refused.  With ``by="tokens"`` each stage is a fresh token-deadline walk from
its position (:class:`~shardloader.plan.tokenblend.TokenMixOrder`).  Planners whose step holds
a number of samples known only after planning (packing, buckets, token budgets), and node
partitions (each takes its own positions of the blend, so a step is no fixed stretch of the
stream), are refused.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from shardloader.errors import ResumeError, UsageError
from shardloader.plan.mixcounts import source_counts

__all__ = ["Stages", "check_stages", "stage_positions", "stage_counts", "saved_step_size"]

Stages = tuple[tuple[int, tuple[int, ...]], ...]  # (first step, integer parts)


def check_stages(
    weights: Mapping[str, float] | None,
    stages: Sequence[tuple[int, Mapping[str, float]]] | None,
    planner: Any,
    batch_size: Any,
    most: int,
    parts_of: Callable[[Mapping[str, float], str], tuple[int, ...]],
) -> Stages:
    """``stages`` as ``(step, integer parts)``, checked (``parts_of`` turns one stage's
    weights into parts); at most ``most`` of them; ``()`` for a mixture of ``weights``."""
    if stages is None:
        if weights is None:
            raise UsageError("a Mixture needs weights={name: weight} or stages=[(step, ...)]")
        return ()
    if weights is not None:
        raise UsageError("pass weights= or stages=, not both: stages carry the weights")
    if planner is not None or not batch_size:
        what = "no batch_size" if planner is None else type(planner).__name__
        raise UsageError(
            f"stages change weights at optimizer steps, which need fixed batches "
            f"(batch_size=N); with {what} the samples of a step are known only after "
            "planning: use batch_size=, or weights= with set_weights at mixture epochs"
        )
    try:
        steps = [(operator.index(st), w) for st, w in stages]
    except (TypeError, ValueError) as err:
        raise UsageError(f"stages must be [(step, {{name: weight}}), ...], got {stages!r}") from err
    if not steps or steps[0][0] != 0:
        raise UsageError(f"the first stage must begin at step 0, got {stages!r}")
    if any(a[0] >= b[0] for a, b in zip(steps, steps[1:], strict=False)):
        raise UsageError(f"stage steps must increase, got {[st for st, _ in steps]}")
    if len(steps) > most:
        raise UsageError(f"a mixture holds at most {most} stages, got {len(steps)}")
    return tuple((st, parts_of(w, f"stage at step {st}")) for st, w in steps)


def stage_positions(
    stages: Stages, per_step: int, epoch_samples: int, uneven: str, partitions: int
) -> list[tuple[int, int]]:
    """``(step, stream position)`` where each stage begins: a step counts the steps of earlier
    mixture epochs as the loader does (the last one of an epoch padded, or dropped with
    ``uneven="drop"``)."""
    if partitions > 1:
        raise UsageError(
            f"stages need one partition of the mixed stream, but this world reads "
            f"{partitions} node partitions, whose steps do not follow the stream "
            "position by position: pass world=shardloader.World(partition='global') (every "
            "node reads every source's shards), or weights= with set_weights at epochs"
        )
    e = epoch_samples
    per_epoch = max(e // per_step if uneven == "drop" else -(-e // per_step), 1)
    return [(st, st // per_epoch * e + min(st % per_epoch * per_step, e)) for st, _ in stages]


def stage_counts(
    starts: list[tuple[int, int]],
    weights: list[dict[str, float]],
    order: Callable[[int], np.ndarray],
    epoch_samples: int,
    epochs: int,
    sizes: Mapping[str, int],
    lengths: np.ndarray | None,
) -> list[dict[str, Any]]:
    """Per stage: its step, epoch, stream position, positions, ``weights`` and per source
    (``sizes``: its samples, in order) documents and tokens (None without lengths) in the
    first ``epochs`` mixture epochs, from the blended ``order(epoch)`` of virtual ids."""
    horizon, e = epochs * epoch_samples, epoch_samples
    ends = [pos for _, pos in starts[1:]] + [horizon]
    out = []
    for (step, lo), hi, weight in zip(starts, ends, weights, strict=True):
        lo, hi = min(lo, horizon), min(hi, horizon)
        ids = [order(x)[max(lo - x * e, 0) : hi - x * e] for x in range(lo // e, -(-hi // e))]
        got = np.concatenate([np.zeros(0, np.int64), *ids]).astype(np.int64)
        of = None if lengths is None else lengths[got]
        samples, tokens = source_counts(got, list(sizes.values()), of)
        per_source = {
            n: {"samples": int(samples[s]), "tokens": None if tokens is None else int(tokens[s])}
            for s, n in enumerate(sizes)
        }
        out.append({
            "step": step, "epoch": lo // e, "position": lo, "positions": hi - lo,
            "weights": weight, "sources": per_source,
        })  # fmt: skip
    return out


def saved_step_size(saved: Mapping[str, Any], stages: Stages) -> int:
    """The step size a saved state put its stages at; they must be ``stages``."""
    mine = [[st, list(p)] for st, p in stages]
    if saved.get("stages") != mine:
        raise ResumeError(
            f"saved stages {saved.get('stages')!r} are not this mixture's {mine}: pass the "
            "same stages (a staged mixture cannot change weights at a resume)"
        )
    per_step = saved.get("samples_per_step")
    if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 1:
        raise ResumeError(f"saved samples_per_step {per_step!r} must be an integer >= 1")
    return per_step
