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
from typing import Any

import numpy as np

from shardloader.errors import ResumeError
from shardloader.plan.lists import NodeLists, cut, units_of
from shardloader.plan.order import EpochOrder
from shardloader.plan.partition import spans
from shardloader.plan.shuffle import regroup_rng

EpochPlanner = Any  # shardloader.plan.epoch's, which imports this module

__all__ = ["MAX_RESHAPES", "Reshape", "elastic_field", "replan", "shape_of", "saved_shape"]

MAX_RESHAPES = 8
Reshape = tuple[int, ...]  # (elastic option's value, [partitions,] global batches consumed)
Link = tuple[int, int, int]  # (elastic option's value, partitions, global batches consumed)


def elastic_field(planning: EpochPlanner) -> str | None:
    """The option a resume may change: ``batch_size`` for fixed batches, else the planner's
    ``elastic`` attribute (None: the planner cannot change shape mid-epoch)."""
    if planning.planner is None:
        return "batch_size"
    return planning.planner.elastic


def shape_of(planning: EpochPlanner) -> int | None:
    """The current value of :func:`elastic_field`."""
    name = elastic_field(planning)
    owner = planning if planning.planner is None else planning.planner
    return None if name is None else int(getattr(owner, name))


def with_shape(planning: EpochPlanner, value: int) -> EpochPlanner:
    """The same planning with the elastic option set to ``value`` (0: as it is, for a link
    that only changed the partitions of a planner that cannot change shape)."""
    name = elastic_field(planning)
    if value == 0 or value == shape_of(planning):
        return planning
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
    value = int(found.group(1)) if found else 0
    if value < 1:
        return None
    try:
        candidate = with_shape(planning, value)
    except Exception:  # options the planner refuses: not this plan
        return None
    return value if candidate.signature() == saved_plan else None


def _remove(rest: np.ndarray, taken: Sequence[np.ndarray]) -> np.ndarray:
    """``rest`` without what ``taken`` delivered, in its order.  A multiset difference: an id
    that ``rest`` holds several times (a mixture's small source, in several of its own epochs)
    loses as many occurrences as were delivered, the earliest first."""
    if not taken:
        return rest
    done = np.concatenate(taken)
    if rest.ndim == 1:
        return rest[_keep(rest, done)]
    # a segment (id, start, stop) is known by its id and start
    span = int(max(rest[:, 1].max(initial=0), done[:, 1].max(initial=0))) + 1
    return rest[_keep(rest[:, 0] * span + rest[:, 1], done[:, 0] * span + done[:, 1])]


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


def regroup(
    planning: EpochPlanner,
    epoch: int,
    link: int,
    rests: Sequence[np.ndarray],
    nodes: int,
    lengths: np.ndarray | None,
) -> list[np.ndarray]:
    """NOTE [re-partition]: what the partitions of an earlier link left, dealt to ``nodes``
    new partitions.  The rest is put back in stream order (each id where the epoch's shard
    permutation lays it, so a shard's samples are neighbours again; segments after their
    sample), cut into ``nodes`` spans that differ by at most one, and each span is shuffled
    in blocks of ``shuffle.block`` with draws of its own (``regroup_rng``).  A new partition
    then reads the shards of its span, and only the shards cut by span ends are read twice:
    the rest keeps the locality of a fresh epoch."""
    rest = np.concatenate(rests) if rests else np.zeros(0, np.int64)
    if not len(rest):
        return [rest[:0] for _ in range(nodes)]
    units = units_of(planning, lengths)
    stream = EpochOrder(units, planning.seed, epoch, planning.shuffle)
    where = np.empty(len(units), np.int64)  # each shard's start in the permuted stream
    where[stream.shard_perm] = stream.run_starts[:-1]
    ids = rest if rest.ndim == 1 else rest[:, 0]
    shard = np.searchsorted(stream.starts, ids, side="right") - 1
    key = where[shard] + ids - stream.starts[shard]
    by = np.argsort(key, kind="stable") if rest.ndim == 1 else np.lexsort((rest[:, 1], key))
    rest = rest[by]
    bounds = spans(len(rest), nodes)
    out = []
    for n in range(nodes):
        mine = rest[bounds[n] : bounds[n + 1]]
        if planning.shuffle.enabled and len(mine):
            block = planning.shuffle.block
            parts = [mine[lo : lo + block] for lo in range(0, len(mine), block)]
            draws = [regroup_rng(planning.seed, epoch, link, n, b) for b in range(len(parts))]
            mine = np.concatenate(
                [p[r.permutation(len(p))] for p, r in zip(parts, draws, strict=True)]
            )
        out.append(mine)
    return out


def normalise(history: Sequence[Sequence[int]]) -> tuple[Link, ...]:
    """Links as ``(shape, partitions, consumed)``: a saved pair ``(shape, consumed)`` was read
    in one partition."""
    full = [(link[0], 1, link[1]) if len(link) == 2 else link for link in history]
    return tuple((int(s), int(p), int(c)) for s, p, c in full)


def replan(
    planning: EpochPlanner,
    epoch: int,
    lengths: np.ndarray | None,
    history: Sequence[Link],
    nodes: int,
) -> NodeLists:
    """An epoch after reshapes (NOTE [reshape history]): every partition's batches of what
    the links of ``history`` left, cut with the current shape in ``nodes`` partitions, and
    what each link delivered."""
    earlier: list[tuple[EpochPlanner, list[np.ndarray]]] = []
    before = history[0][1]  # partitions of the previous link
    orders = planning.node_orders(epoch, before, lengths)
    for k, (value, parts, consumed) in enumerate(history):
        if parts != before:
            orders = regroup(planning, epoch, k, orders, parts, lengths)
        link = with_shape(planning, value)
        lists = [cut(link, o, lengths, epoch, n, parts) for n, o in enumerate(orders)]
        counts = [len(got.batches) for got in lists]
        if consumed % parts or not 0 <= consumed // parts < max(counts, default=0) + (
            not any(counts)
        ):
            raise ResumeError(
                f"saved reshape history {list(history)!r}: {consumed} batches consumed with "
                f"{elastic_field(planning)}={value} in {parts} partition(s), but that plan has "
                f"{counts} batches a partition in epoch {epoch}"
            )
        # each partition's first consumed slots (past its batches: repeats from its start,
        # as split.rank_slots deals them)
        taken = [
            [got.batches[q % c] for q in range(consumed // parts)] if c else []
            for got, c in zip(lists, counts, strict=True)
        ]
        earlier.append((link, [b for mine in taken for b in mine]))
        rests = []
        for order, mine in zip(orders, taken, strict=True):
            if mine and mine[0].ndim == 2 and order.ndim == 1:  # segments: what was cut
                order = link.planner.segments(order, lengths)
            rests.append(_remove(order, mine))
        orders, before = rests, parts
    if nodes != before:
        orders = regroup(planning, epoch, len(history), orders, nodes, lengths)
    final = {n: cut(planning, o, lengths, epoch, n, nodes) for n, o in enumerate(orders)}
    sizes = tuple(len(final[n].batches) for n in range(nodes))
    return NodeLists(sizes, final, tuple(earlier))


def read_table(values: Sequence[int], width: int) -> list[tuple[int, ...]]:
    """Rows of ``width`` integers from a shared control block laid out as their count, then
    the rows one after another (the reshape history here, a mixture's weight schedule)."""
    at = range(1, 1 + int(values[0]) * width, width)
    return [tuple(int(v) for v in values[a : a + width]) for a in at]


def flat_table(rows: Sequence[Sequence[int]], width: int, most: int) -> list[int]:
    """``rows`` (at most ``most``) in :func:`read_table`'s layout, zeros up to its capacity."""
    flat = [len(rows), *(int(v) for row in rows for v in row)]
    return flat + [0] * (1 + most * width - len(flat))


def history_of(values: Sequence[int]) -> tuple[Reshape, ...]:
    """Decode the dataset's control block: links ``(shape, partitions, consumed)``; a link
    read in one partition comes back as the pair ``(shape, consumed)``."""
    return tuple((s, c) if p == 1 else (s, p, c) for s, p, c in read_table(values, 3))


def encode_history(history: Sequence[Reshape]) -> list[int]:
    if len(history) > MAX_RESHAPES:
        raise ResumeError(
            f"{len(history)} batch-shape or partition changes within one epoch; at most "
            f"{MAX_RESHAPES} are kept: resume with the saved shape, or from the start of the "
            "next epoch"
        )
    return flat_table(normalise(history), 3, MAX_RESHAPES)


def check_history(saved: Any) -> tuple[Reshape, ...]:
    """A saved ``reshapes`` list, checked: pairs ``[shape, batches]`` or triples ``[shape,
    partitions, batches]`` of non-negative integers."""
    try:
        links = tuple(tuple(int(v) for v in link) for link in saved)
    except (TypeError, ValueError) as err:
        raise ResumeError(
            f"saved reshapes {saved!r} must be [[shape, batches], ...] as state_dict() writes"
        ) from err
    if any(len(link) not in (2, 3) for link in links):
        raise ResumeError(f"saved reshapes {saved!r}: each link is [shape, (partitions,) batches]")
    if any(link[0] < 1 or link[-1] < 0 or (len(link) == 3 and link[1] < 1) for link in links):
        raise ResumeError(f"saved reshapes {saved!r} hold a shape < 1 or a negative count")
    return links


__all__ += ["history_of", "encode_history", "check_history", "with_shape", "normalise", "regroup"]
