"""Elastic resume at sample granularity: continue an epoch with another batch shape.

A saved position counts global batches of one plan.  Keeping the global batch while the world
changes (2 ranks x 6 samples -> 3 ranks x 4) changes the per-rank batch, so the saved plan
(``fixed(6)``) is no longer the plan (``fixed(4)``).  The planner names the one option that
may change at a resume (its ``elastic`` attribute: ``batch_size``, ``rows_per_batch``,
``max_tokens``; ``batch_size=`` for plain fixed batches); every other option must stay.

NOTE [reshape history]
    A resumed epoch is a chain of links ``(shape, consumed)``: link 0 plans the whole epoch
    order with the first shape and its first ``consumed`` global batches were delivered; each
    next link plans what is left (samples, or for segment planners the token segments, that
    no earlier link delivered) with its shape, and so on; the current shape plans the rest,
    and the live position counts its batches.  Every process rebuilds the same chain from
    ``(seed, epoch, history)`` alone, so ranks and workers agree without talking, and the
    rest is exactly what was not delivered: no sample (no token) twice, none skipped.  Mid
    epoch a position never reaches the padding that evens out ranks (``split.rank_slots``:
    the last round of steps ends the pass), so consumed batches are real ones.  The history
    is a few integers in the loader state (``reshapes``) and in the dataset's shared control
    block (:data:`MAX_RESHAPES` links per epoch).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from shardloader.errors import ResumeError
from shardloader.shuffle import plan_rng
from shardloader.split import cut_fixed_batches

EpochPlanner = Any  # shardloader.epoch's, which imports this module

__all__ = ["MAX_RESHAPES", "Reshape", "elastic_field", "replan", "shape_of", "saved_shape"]

MAX_RESHAPES = 8
Reshape = tuple[int, int]  # (value of the elastic option, global batches consumed with it)


def elastic_field(planning: EpochPlanner) -> str | None:
    """The option a resume may change: ``batch_size`` for fixed batches, else the planner's
    ``elastic`` attribute (None: the planner cannot change shape mid-epoch)."""
    if planning.planner is None:
        return "batch_size"
    name = getattr(planning.planner, "elastic", None)
    return name if isinstance(name, str) else None


def shape_of(planning: EpochPlanner) -> int | None:
    """The current value of :func:`elastic_field`."""
    name = elastic_field(planning)
    if name is None:
        return None
    owner = planning if planning.planner is None else planning.planner
    return int(getattr(owner, name))


def with_shape(planning: EpochPlanner, value: int) -> EpochPlanner:
    """The same planning with the elastic option set to ``value``."""
    name = elastic_field(planning)
    if name is None:
        raise ResumeError(f"{type(planning.planner).__name__} cannot change its batch shape")
    if planning.planner is None:
        return dataclasses.replace(planning, batch_size=value)
    return dataclasses.replace(
        planning, planner=dataclasses.replace(planning.planner, **{name: value})
    )


def saved_shape(planning: EpochPlanner, saved_plan: str) -> int | None:
    """The elastic value a saved plan signature was made with, if that signature is this
    planning's with only that value changed; else None (a different plan)."""
    name = elastic_field(planning)
    if name is None or not isinstance(saved_plan, str):
        return None
    pattern = r"^fixed\((\d+)\);" if planning.planner is None else rf"\b{name}=(\d+)\b"
    found = re.search(pattern, saved_plan)
    if found is None:
        return None
    value = int(found.group(1))
    if value < 1:
        return None
    try:
        candidate = with_shape(planning, value)
    except Exception:  # options the planner refuses: not this plan
        return None
    return value if candidate.signature() == saved_plan else None


def _cut(
    planning: EpochPlanner, rest: np.ndarray, lengths: np.ndarray | None, epoch: int
) -> tuple[list[np.ndarray], int, int]:
    """Batches of ``rest`` (ids ``[n]`` or segments ``[n, 3]``) under ``planning``; with the
    padded and dropped sample counts of fixed batches."""
    rng = plan_rng(planning.seed, epoch)
    if getattr(planning.planner, "plan_stream", None) is not None:  # rows of token streams
        return list(planning.planner.plan_rows(rest)), 0, 0
    if planning.planner is None:
        return cut_fixed_batches(rest, planning.batch_size or 1, planning.uneven)
    if rest.ndim == 2:
        plan_segments = getattr(planning.planner, "plan_segments", None)
        if plan_segments is None:
            raise ResumeError(
                f"{type(planning.planner).__name__} plans segments but cannot re-plan the rest "
                "of an epoch (no plan_segments): resume with the saved batch shape"
            )
        return list(plan_segments(rest, rng)), 0, 0
    return list(planning.planner.plan(rest, lengths, rng)), 0, 0


def _segment_keys(segs: np.ndarray, span: int) -> np.ndarray:
    return segs[:, 0] * span + segs[:, 1]


def _remove(rest: np.ndarray, taken: Sequence[np.ndarray]) -> np.ndarray:
    """``rest`` without what ``taken`` delivered, in its order.  A multiset difference: an id
    that ``rest`` holds several times (a mixture's small source, in several of its own epochs)
    loses as many occurrences as were delivered, the earliest first."""
    if not taken:
        return rest
    done = np.concatenate(taken)
    if rest.ndim == 1:
        return rest[_keep(rest, done)]
    span = int(max(rest[:, 1].max(initial=0), done[:, 1].max(initial=0))) + 1
    return rest[_keep(_segment_keys(rest, span), _segment_keys(done, span))]


def _keep(keys: np.ndarray, done: np.ndarray) -> np.ndarray:
    """Mask of ``keys`` to keep: for each value, its first ``count in done`` occurrences go."""
    if len(done) == 0:
        return np.ones(len(keys), bool)
    order = np.argsort(keys, kind="stable")
    ranked = keys[order]
    first = np.searchsorted(ranked, ranked, side="left")
    occurrence = np.empty(len(keys), np.int64)
    occurrence[order] = np.arange(len(keys)) - first  # 0 for a value's first occurrence
    values, counts = np.unique(done, return_counts=True)
    at = np.clip(np.searchsorted(values, keys), 0, len(values) - 1)
    delivered = np.where(values[at] == keys, counts[at], 0)
    return occurrence >= delivered


class Replanned(NamedTuple):
    order: np.ndarray
    batches: list[np.ndarray]
    pad_in_last: int
    dropped: int
    earlier: tuple[tuple[Any, list[np.ndarray]], ...]


def replan(
    planning: EpochPlanner, epoch: int, lengths: np.ndarray | None, history: Sequence[Reshape]
) -> Replanned:
    """An epoch after reshapes (NOTE [reshape history]): the current shape's batches of what
    the links of ``history`` left, and what each link delivered."""
    stream = getattr(planning.planner, "plan_stream", None)
    if stream is not None:  # TokenBlocks: the order is of rows (batching/blocks.py)
        order = stream(planning.shard_sizes, lengths, planning.seed, epoch, planning.shuffle)[0]
    else:
        order = planning.order(epoch)  # a mixture's blend too
    rest: np.ndarray = order
    earlier: list[tuple[EpochPlanner, list[np.ndarray]]] = []
    for value, consumed in history:
        link = with_shape(planning, value)
        batches, _, _ = _cut(link, rest, lengths, epoch)
        if not 0 <= consumed < len(batches) + (not batches):
            raise ResumeError(
                f"saved reshape history {list(history)!r}: {consumed} batches consumed with "
                f"{elastic_field(planning)}={value}, but that plan has {len(batches)} in "
                f"epoch {epoch}"
            )
        taken = batches[:consumed]
        earlier.append((link, taken))
        if rest is order and taken and taken[0].ndim == 2:  # segments: what the plan cuts
            rest = link.planner.segments(order, lengths)
        rest = _remove(rest, taken)
    batches, pad_in_last, dropped = _cut(planning, rest, lengths, epoch)
    return Replanned(order, batches, pad_in_last, dropped, tuple(earlier))


def history_of(values: Sequence[int]) -> tuple[Reshape, ...]:
    """Decode the dataset's control block: ``[n, shape0, consumed0, ...]``."""
    n = int(values[0])
    return tuple((int(values[1 + 2 * i]), int(values[2 + 2 * i])) for i in range(n))


def encode_history(history: Sequence[Reshape]) -> list[int]:
    if len(history) > MAX_RESHAPES:
        raise ResumeError(
            f"{len(history)} batch-shape changes within one epoch; at most {MAX_RESHAPES} are "
            "kept: resume with the saved shape, or from the start of the next epoch"
        )
    flat = [len(history)]
    for value, consumed in history:
        flat += [int(value), int(consumed)]
    return flat + [0] * (1 + 2 * MAX_RESHAPES - len(flat))


def check_history(saved: Any) -> tuple[Reshape, ...]:
    """A saved ``reshapes`` list, checked: pairs of non-negative integers."""
    try:
        pairs = tuple((int(v), int(c)) for v, c in saved)
    except (TypeError, ValueError) as err:
        raise ResumeError(
            f"saved reshapes {saved!r} must be [[shape, batches], ...] as state_dict() writes"
        ) from err
    if any(v < 1 or c < 0 for v, c in pairs):
        raise ResumeError(f"saved reshapes {saved!r} hold a shape < 1 or a negative count")
    return pairs


__all__ += ["Replanned", "history_of", "encode_history", "check_history", "with_shape"]
