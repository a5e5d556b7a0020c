"""The one accounting rule of every planner: what a plan's batches deliver of an order.

:func:`account` counts per occurrence (NOTE [occurrences]); :class:`PlanReport` holds the
counts (NOTE [what a batch is] in :mod:`shardloader.batching.base` says what it counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.errors import UsageError

__all__ = ["PlanReport", "TokenShares", "account", "as_ids", "segment_counts"]


class TokenShares:
    """What a report's token counts (None without lengths) add up to; the name of its field of
    allocated token slots is ``SLOTS``."""

    SLOTS = "token_slots"
    tokens: int | None
    truncated_tokens: int | None
    dropped_tokens: int | None
    repeated_tokens: int | None

    @property
    def total_tokens(self) -> int | None:
        """Every token: delivered + truncated + dropped."""
        if self.tokens is None:
            return None
        return self.tokens + (self.truncated_tokens or 0) + (self.dropped_tokens or 0)

    @property
    def pad_fraction(self) -> float | None:
        """Share of the allocated token slots that is padding: neither delivered nor repeated."""
        slots = getattr(self, self.SLOTS)
        if self.tokens is None or not slots:
            return None
        return 1.0 - (self.tokens + (self.repeated_tokens or 0)) / slots


@dataclass(frozen=True)
class PlanReport(TokenShares):
    """What a plan delivers and what its policies cost; computed purely by ``report()``.

    Token fields are ``None`` when no lengths were given; then ``tokens + truncated_tokens +
    dropped_tokens`` is every token of the order.  An occurrence of a sample in the order is
    *dropped* when none of it is delivered, *truncated* when only part of it is.
    ``padded_tokens`` counts the token slots the collate allocates (real tokens, repeats and
    padding).
    """

    SLOTS = "padded_tokens"
    num_samples: int  # ids in the order
    num_batches: int
    # one id per occurrence in the order (NOTE [occurrences] in :func:`account`):
    dropped: tuple[int, ...] = ()  # delivered not at all (tail, oversize, long-doc policy)
    truncated: tuple[int, ...] = ()  # delivered only in part
    split: tuple[int, ...] = ()  # ids delivered in several segments (packed)
    tokens: int | None = None  # tokens delivered, each counted once
    truncated_tokens: int | None = None  # tokens of truncated samples left out
    dropped_tokens: int | None = None  # tokens of dropped samples
    repeated_tokens: int | None = None  # tokens delivered again (batches repeated to even ranks)
    padded_tokens: int | None = None  # token slots allocated


def as_ids(order: np.ndarray) -> np.ndarray:
    ids = np.asarray(order)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise UsageError(
            f"order must be a 1-D integer array of sample ids, got {ids.dtype}{ids.shape}"
        )
    return ids.astype(np.int64, copy=False)


def segment_counts(order: np.ndarray, segs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct segments ``(id, start, stop)`` of ``segs`` (sorted by id) and how many
    occurrences of the order each serves: its count in the batches, at most the id's count in
    ``order`` (a repeat past that, a batch repeated to even out ranks, serves none)."""
    cat = np.concatenate(segs) if segs else np.zeros((0, 3), np.int64)
    uniq, count = np.unique(cat, axis=0, return_counts=True)
    ids = as_ids(order)
    size = max(int(ids.max()) + 1 if ids.size else 0, int(uniq[:, 0].max()) + 1 if len(uniq) else 0)
    want = np.bincount(ids, minlength=size)
    return uniq, np.minimum(count, want[uniq[:, 0]])


def account(
    order: np.ndarray,
    lengths: np.ndarray | None,
    batches: Sequence[np.ndarray],
    *,
    max_length: int | None = None,
    pad_to_multiple_of: int = 1,
    row_shape: tuple[int, int] | None = None,
) -> PlanReport:
    """Count what ``batches`` deliver of ``order``: the one accounting rule of every planner.

    ``[k]`` batches deliver each sample's first ``max_length`` tokens and are padded to their
    longest, rounded up to ``pad_to_multiple_of``; ``[k, 3]`` batches deliver their segments
    and each costs ``row_shape`` (rows, seq_len) slots.

    NOTE [occurrences]: a sample may stand in the order more than once (a mixture draws a
    small source's samples again within one of its epochs), so everything is counted per
    occurrence: an id listed ``k`` times is delivered up to ``k`` times, and each occurrence
    that is not is dropped (or, delivered in part, truncated), with its tokens.  Deliveries
    past ``k`` (a batch repeated to even out ranks) are repeats, their tokens
    ``repeated_tokens``.  A segment serves one occurrence per delivery, so occurrence ``j`` of
    a document gets the segments delivered at least ``j`` times.
    """
    ids = as_ids(order)
    flat = [b for b in batches if b.ndim == 1 and b.size]
    segs = [b for b in batches if b.ndim == 2 and b.size]
    flat_ids = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    tops = [int(a.max()) + 1 for a in (ids, flat_ids, *(b[:, 0] for b in segs)) if a.size]
    size = max([*tops, 0 if lengths is None else int(np.asarray(lengths).size)])
    want = np.bincount(ids, minlength=size)  # occurrences of each sample in the order
    got = np.zeros(size, np.int64)  # occurrences delivered at all (at most ``want``)
    whole = np.zeros(size, np.int64)  # occurrences delivered whole
    delivered = np.zeros(size, np.int64)  # tokens delivered, each occurrence's once
    pieces = np.zeros(size, np.int64)  # distinct segments delivered per sample
    all_tokens = 0  # tokens delivered, repeats included
    lens = None if lengths is None else np.zeros(size, np.int64)
    if lens is not None:
        given = np.asarray(lengths, dtype=np.int64)
        lens[: given.size] = given
    eff = lens if lens is None or max_length is None else np.minimum(lens, max_length)
    if flat:
        n = np.minimum(np.bincount(flat_ids, minlength=size), want)
        got += n
        if lens is not None and eff is not None:
            delivered += n * eff
            whole += np.where(eff >= lens, n, 0)
            all_tokens += int(eff[flat_ids].sum())
        else:
            whole += n
    if segs:
        uniq, m = segment_counts(ids, segs)
        sid, span = uniq[:, 0], uniq[:, 2] - uniq[:, 1]
        np.add.at(pieces, sid, 1)
        np.add.at(delivered, sid, m * span)
        most = np.zeros(size, np.int64)
        np.maximum.at(most, sid, m)
        least = np.full(size, np.iinfo(np.int64).max)
        np.minimum.at(least, sid, m)
        got += most
        if lens is not None:
            covered = np.zeros(size, np.int64)  # tokens of the distinct segments
            np.add.at(covered, sid, span)
            whole += np.where((most > 0) & (covered >= lens), least, 0)
        else:
            whole += np.where(most > 0, least, 0)
        all_tokens += int(sum(int((b[:, 2] - b[:, 1]).sum()) for b in segs))
    every = np.arange(size)
    dropped = np.repeat(every, want - got)
    truncated = np.repeat(every, got - whole)
    split = np.flatnonzero(pieces > 1)
    common: dict[str, Any] = {
        "num_samples": int(ids.size),
        "num_batches": len(batches),
        "dropped": tuple(dropped.tolist()),
        "truncated": tuple(truncated.tolist()),
        "split": tuple(split.tolist()),
    }
    if lens is None or eff is None:
        return PlanReport(**common)
    tokens = int(delivered.sum())
    slots = 0
    if row_shape is not None:
        slots += len(segs) * row_shape[0] * row_shape[1]
    if flat:  # each batch: its size times its padded longest
        sizes = np.fromiter((b.size for b in flat), np.int64, len(flat))
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        longest = np.maximum.reduceat(eff[flat_ids], starts)
        step = pad_to_multiple_of
        slots += int((sizes * (-(-longest // step) * step)).sum())
    return PlanReport(
        **common,
        tokens=tokens,
        truncated_tokens=int((got * lens - delivered).sum()),
        dropped_tokens=int(((want - got) * lens).sum()),
        repeated_tokens=all_tokens - tokens,
        padded_tokens=slots,
    )
