"""Batch planners: cut the epoch's global order into global batches.

A planner is a pure function of ``(order, lengths, rng)``: the same inputs give the same batches
in every process, whatever the world size or worker count (the dataset deals batch ``i`` to rank
``i mod W``).  Planners hold only frozen options, so they pickle into workers.

NOTE [what a batch is]
    A planned batch is an int64 array in one of two shapes:

    * ``[k]``: sample ids.  The collate gets the k samples whole, in this order (an id may
      repeat only where the dataset pads a batch up).
    * ``[k, 3]``: segments ``(sample id, token start, token stop)`` of the samples' length field
      (the field whose lengths the manifest records, e.g. ``tokens``).  The dataset reads each
      sample once and hands the collate one sample per segment, in this order, with that field
      cut to ``[start:stop]`` and ``__span__ = (start, stop)``.  A sample's segments may lie in
      different batches; together they never overlap.  :class:`PackedBatches` plans these, so
      a document of any length loses no token.

    Code that needs the samples a batch reads (locating shards, working sets, padding masks)
    goes through :func:`batch_ids`; token counts go through the planner's ``report``.

NOTE [planner and collate agree without talking]
    Whatever the collate must know about the plan (padded length, truncation, the row of each
    packed segment) is re-derived in the worker from the batch alone, with the same function
    the planner used: :func:`padded_length` for bucketing and budgets, :func:`pack_rows` for
    packing.  The options must match, so the dataset asks the planner: ``resolve_collate``
    refuses a collate whose options disagree (naming both values) and, given none, builds one
    (``make_collate``) when the planner knows enough (``PackedBatches(pad_id=...)``).

Every planner also has a pure ``report(order, lengths, batches) -> PlanReport`` that says what
its policies dropped, truncated or split, counts every token of the epoch as delivered,
truncated or dropped, and says how many token slots (real tokens plus padding) the batches cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from shardloader.errors import UsageError

if TYPE_CHECKING:
    from shardloader.collate import PackCollate, PadCollate

__all__ = [
    "BatchPlanner",
    "PlanReport",
    "FixedBatches",
    "BucketBatches",
    "TokenBudgetBatches",
    "PackedBatches",
    "batch_ids",
    "padded_length",
    "pack_rows",
    "Segment",
]

OVERSIZE_POLICIES = ("error", "truncate", "drop")
LONG_DOC_POLICIES = ("split", "truncate", "drop")
TAIL_POLICIES = ("keep", "drop")
_DEFAULT_WINDOW = 4096


@runtime_checkable
class BatchPlanner(Protocol):
    """Cuts an epoch's order into global batches; see the module docstring."""

    needs_lengths: bool

    def plan(
        self, order: np.ndarray, lengths: np.ndarray | None, rng: np.random.Generator
    ) -> list[np.ndarray]:
        """Return global batches (int64 ids ``[k]`` or segments ``[k, 3]``); every sample of
        ``order`` is delivered exactly once (whole, or in non-overlapping pieces), except what
        a documented policy truncates or drops (see ``report``)."""
        ...


@dataclass(frozen=True)
class PlanReport:
    """What a plan delivers and what its policies cost; computed purely by ``report()``.

    Token fields are ``None`` when no lengths were given; then ``tokens + truncated_tokens +
    dropped_tokens`` is every token of the order.  A sample is *dropped* when none of it is
    delivered, *truncated* when only part of it is.  ``padded_tokens`` counts the token slots
    the collate allocates (real tokens, repeats and padding).
    """

    num_samples: int  # ids in the order
    num_batches: int
    dropped: tuple[int, ...] = ()  # ids delivered not at all (tail, oversize, long-doc policy)
    truncated: tuple[int, ...] = ()  # ids delivered only in part
    split: tuple[int, ...] = ()  # ids delivered in several segments (packed)
    tokens: int | None = None  # tokens delivered, each counted once
    truncated_tokens: int | None = None  # tokens of truncated samples left out
    dropped_tokens: int | None = None  # tokens of dropped samples
    repeated_tokens: int | None = None  # tokens delivered again (batches repeated to even ranks)
    padded_tokens: int | None = None  # token slots allocated

    @property
    def total_tokens(self) -> int | None:
        """Every token of the order: delivered + truncated + dropped."""
        if self.tokens is None:
            return None
        return self.tokens + (self.truncated_tokens or 0) + (self.dropped_tokens or 0)

    @property
    def pad_fraction(self) -> float | None:
        """Share of allocated token slots that are padding."""
        if self.tokens is None or not self.padded_tokens:
            return None
        return 1.0 - (self.tokens + (self.repeated_tokens or 0)) / self.padded_tokens


# ---------------------------------------------------------------------------------------------
# shared helpers


def batch_ids(batch: np.ndarray) -> np.ndarray:
    """The samples a batch reads, in reading order: a ``[k]`` batch as it is, a ``[k, 3]``
    segment batch's sample ids each once, in the order of their first segment."""
    b = np.asarray(batch)
    if b.ndim == 1:
        return b
    ids = b[:, 0]
    _, first = np.unique(ids, return_index=True)
    return ids[np.sort(first)]


def padded_length(longest: int, pad_to_multiple_of: int = 1) -> int:
    """The length PadCollate pads a batch whose longest sample is ``longest`` to."""
    m = pad_to_multiple_of
    return -(-longest // m) * m


def _positive(name: str, value: int | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise UsageError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _ids(order: np.ndarray) -> np.ndarray:
    ids = np.asarray(order)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise UsageError(
            f"order must be a 1-D integer array of sample ids, got {ids.dtype}{ids.shape}"
        )
    return ids.astype(np.int64, copy=False)


def _lengths_of(planner: str, ids: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """Lengths of ``ids`` (indexed by global id), with a clear error when they are missing."""
    if lengths is None:
        raise UsageError(
            f"{planner} needs per-sample lengths: pack with a length field (e.g. --tokenizer, "
            "which records token counts in the manifest) or use FixedBatches"
        )
    lens = np.asarray(lengths)
    if lens.ndim != 1 or (lens.size and lens.dtype.kind not in "iu"):
        raise UsageError(f"lengths must be a 1-D integer array, got {lens.dtype}{lens.shape}")
    if ids.size and (ids.max() >= lens.size or ids.min() < 0):
        raise UsageError(
            f"sample id {int(ids.max())} is outside lengths (size {lens.size}); lengths must be "
            "indexed by global sample id"
        )
    if lens.size and lens.min() < 0:
        raise UsageError(f"lengths contains a negative length ({int(lens.min())})")
    return lens[ids].astype(np.int64, copy=False)


def _shuffled(batches: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    return [batches[i] for i in rng.permutation(len(batches))]


def _disagree(collate: Any, planner: Any, pairs: Sequence[tuple[str, Any, Any]]) -> None:
    """Raise naming every option where ``collate`` and ``planner`` differ."""
    diffs = [(name, mine, theirs) for name, mine, theirs in pairs if mine != theirs]
    if not diffs:
        return
    what = "; ".join(
        f"{type(collate).__name__} {name}={theirs!r}, {type(planner).__name__} {name}={mine!r}"
        for name, mine, theirs in diffs
    )
    raise UsageError(
        f"collate_fn disagrees with the planner ({what}): the batches would not have the "
        "planned shape or tokens; build the collate with planner.make_collate(...) or leave "
        "collate_fn out where the planner can build it"
    )


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
    and each costs ``row_shape`` (rows, seq_len) slots.  A sample or segment that appears again
    (a batch repeated to even out ranks) counts once; the repeat goes to ``repeated_tokens``.
    """
    ids = _ids(order)
    size = int(ids.max()) + 1 if ids.size else 0
    if lengths is not None:
        size = max(size, int(np.asarray(lengths).size))
    flat = [b for b in batches if b.ndim == 1 and b.size]
    segs = [b for b in batches if b.ndim == 2 and b.size]
    delivered = np.zeros(size, np.int64)  # tokens delivered per sample, each counted once
    pieces = np.zeros(size, np.int64)  # distinct segments delivered per sample
    seen = np.zeros(size, bool)
    all_tokens = 0  # tokens delivered, repeats included
    lens = None if lengths is None else np.asarray(lengths, dtype=np.int64)
    if flat:
        cat = np.concatenate(flat)
        seen[cat] = True
        if lens is not None:
            eff = lens if max_length is None else np.minimum(lens, max_length)
            delivered[seen] = eff[seen]
            all_tokens += int(eff[cat].sum())
    if segs:
        cat = np.concatenate(segs)
        uniq = np.unique(cat, axis=0)
        seen[uniq[:, 0]] = True
        np.add.at(pieces, uniq[:, 0], 1)
        np.add.at(delivered, uniq[:, 0], uniq[:, 2] - uniq[:, 1])
        all_tokens += int((cat[:, 2] - cat[:, 1]).sum())
    in_order = np.zeros(size, bool)
    in_order[ids] = True
    dropped = np.flatnonzero(in_order & ~seen)
    split = np.flatnonzero(pieces > 1)
    common: dict[str, Any] = {
        "num_samples": int(ids.size),
        "num_batches": len(batches),
        "dropped": tuple(dropped.tolist()),
        "split": tuple(split.tolist()),
    }
    if lens is None:
        return PlanReport(**common)
    short = in_order & seen & (delivered < lens)
    tokens = int(delivered[in_order].sum())
    slots = 0
    if row_shape is not None:
        slots += len(segs) * row_shape[0] * row_shape[1]
    if flat:  # each batch: its size times its padded longest
        sizes = np.fromiter((b.size for b in flat), np.int64, len(flat))
        eff = lens if max_length is None else np.minimum(lens, max_length)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        longest = np.maximum.reduceat(eff[np.concatenate(flat)], starts)
        m = pad_to_multiple_of
        slots += int((sizes * (-(-longest // m) * m)).sum())
    return PlanReport(
        **common,
        truncated=tuple(np.flatnonzero(short).tolist()),
        tokens=tokens,
        truncated_tokens=int((lens - delivered)[short].sum()),
        dropped_tokens=int(lens[dropped].sum()),
        repeated_tokens=all_tokens - tokens,
        padded_tokens=slots,
    )


# ---------------------------------------------------------------------------------------------
# fixed count


@dataclass(frozen=True)
class FixedBatches:
    """Consecutive ``batch_size`` ids of the order; ``drop_last`` drops the short last batch."""

    batch_size: int
    drop_last: bool = False
    needs_lengths = False

    def __post_init__(self) -> None:
        _positive("batch_size", self.batch_size)

    def plan(
        self, order: np.ndarray, lengths: np.ndarray | None, rng: np.random.Generator
    ) -> list[np.ndarray]:
        ids = _ids(order)
        n = ids.size - ids.size % self.batch_size if self.drop_last else ids.size
        return [ids[s : s + self.batch_size] for s in range(0, n, self.batch_size)]

    def report(
        self, order: np.ndarray, lengths: np.ndarray | None, batches: Sequence[np.ndarray]
    ) -> PlanReport:
        """Padding and truncation are the collate's here: the dataset passes a PadCollate's
        ``max_length`` and ``pad_to_multiple_of`` to :func:`account` itself."""
        return account(order, lengths, batches)


# ---------------------------------------------------------------------------------------------
# length bucketing and token budgets


def _budget_cuts(
    lens: np.ndarray, max_tokens: int, max_batch_size: int | None, m: int
) -> list[int]:
    """Greedy cut points of ascending ``lens`` so each batch's padded size fits ``max_tokens``."""
    cuts = [0]
    n = lens.size
    start = 0
    while start < n:
        # at most this many samples fit even if all were as short as the first
        limit = max(1, max_tokens // max(padded_length(int(lens[start]), m), 1))
        if max_batch_size is not None:
            limit = min(limit, max_batch_size)
        stop = min(n, start + limit)
        cand = lens[start:stop]
        cost = np.arange(1, cand.size + 1) * (-(-cand // m) * m)  # count * padded longest
        over = np.flatnonzero(cost > max_tokens)
        k = int(over[0]) if over.size else cand.size
        start += max(k, 1)
        cuts.append(start)
    return cuts


def _apply_oversize(
    planner: str, ids: np.ndarray, lens: np.ndarray, limit: int, policy: str
) -> tuple[np.ndarray, np.ndarray]:
    """Apply the policy for samples longer than ``limit``; returns (ids, effective lengths)."""
    over = lens > limit
    if not over.any():
        return ids, lens
    if policy == "error":
        first = int(np.flatnonzero(over)[0])
        raise UsageError(
            f"{planner}: sample {int(ids[first])} has {int(lens[first])} tokens, more than one "
            f"batch may hold ({limit}; {int(over.sum())} such samples in this epoch); raise "
            "max_tokens, or pass oversize='truncate' (and PadCollate(max_length=...), see "
            "make_collate) or oversize='drop'"
        )
    if policy == "drop":
        return ids[~over], lens[~over]
    return ids, np.minimum(lens, limit)  # truncate


@dataclass(frozen=True)
class TokenBudgetBatches:
    """Batches sized by padded tokens: ``len(batch) * padded_longest <= max_tokens``.

    Within each ``window`` consecutive ids of the order, samples are sorted by length (stable),
    cut greedily under the budget, and all batches of the epoch are then shuffled with ``rng``.
    ``pad_to_multiple_of`` must equal the collate's (``make_collate`` does that).  A sample
    whose padded length alone exceeds ``max_tokens`` follows ``oversize``: ``"error"``
    (default), ``"truncate"`` to the largest multiple of ``pad_to_multiple_of`` within the
    budget (the collate cuts it via ``max_length``; reported), or ``"drop"`` (reported).
    """

    max_tokens: int
    window: int = _DEFAULT_WINDOW
    max_batch_size: int | None = None
    pad_to_multiple_of: int = 1
    oversize: str = "error"
    needs_lengths = True

    def __post_init__(self) -> None:
        _positive("max_tokens", self.max_tokens)
        _positive("window", self.window)
        _positive("max_batch_size", self.max_batch_size, optional=True)
        _positive("pad_to_multiple_of", self.pad_to_multiple_of)
        _choice("oversize", self.oversize, OVERSIZE_POLICIES)
        if self.max_tokens < self.pad_to_multiple_of:
            raise UsageError(
                f"max_tokens={self.max_tokens} is smaller than pad_to_multiple_of="
                f"{self.pad_to_multiple_of}: no sample could fit"
            )

    @property
    def max_length(self) -> int:
        """Longest sample (after truncation) a batch can hold."""
        m = self.pad_to_multiple_of
        return self.max_tokens // m * m

    def plan(
        self, order: np.ndarray, lengths: np.ndarray | None, rng: np.random.Generator
    ) -> list[np.ndarray]:
        ids = _ids(order)
        lens = _lengths_of(type(self).__name__, ids, lengths)
        ids, lens = _apply_oversize(type(self).__name__, ids, lens, self.max_length, self.oversize)
        batches: list[np.ndarray] = []
        for s in range(0, ids.size, self.window):
            w_ids, w_lens = ids[s : s + self.window], lens[s : s + self.window]
            by_len = np.argsort(w_lens, kind="stable")
            w_ids, w_lens = w_ids[by_len], w_lens[by_len]
            cuts = _budget_cuts(
                w_lens, self.max_tokens, self.max_batch_size, self.pad_to_multiple_of
            )
            batches += [w_ids[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        return _shuffled(batches, rng)

    def report(
        self, order: np.ndarray, lengths: np.ndarray | None, batches: Sequence[np.ndarray]
    ) -> PlanReport:
        return account(
            order,
            lengths,
            batches,
            max_length=self._truncate_to,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )

    @property
    def _truncate_to(self) -> int | None:
        return self.max_length if self.oversize == "truncate" else None

    def resolve_collate(self, collate_fn: Any, field: str | None) -> Any:
        """The dataset's collate: ``collate_fn`` if a PadCollate agrees with the budget's
        padding and truncation (any other callable is used as given)."""
        from shardloader.collate import PadCollate

        if isinstance(collate_fn, PadCollate):
            _disagree(
                collate_fn,
                self,
                [
                    ("pad_to_multiple_of", self.pad_to_multiple_of, collate_fn.pad_to_multiple_of),
                    ("max_length", self._truncate_to, collate_fn.max_length),
                ],
            )
        return collate_fn

    def make_collate(self, pad_values: dict[str, int | float], **options: object) -> PadCollate:
        """A PadCollate whose padding and truncation match this plan's budget arithmetic."""
        from shardloader.collate import PadCollate

        return PadCollate(
            pad_values,
            pad_to_multiple_of=self.pad_to_multiple_of,
            max_length=self._truncate_to,
            **options,  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class BucketBatches:
    """Length bucketing: batches of similar lengths drawn from a bounded window of the order.

    Give exactly one of ``batch_size`` (fixed count) or ``max_tokens`` (a token budget, the same
    cut as :class:`TokenBudgetBatches` with ``oversize="error"``).  Ids are sorted by length
    within windows of ``window`` consecutive ids of the (already shuffled) order, cut, and the
    batches shuffled with ``rng``: randomness is kept at window scale, padding drops.  With
    ``batch_size`` the window is rounded up to a multiple of it, so only the epoch's last batch
    can be short; ``drop_last`` drops that many ids from the end of the order (not the
    longest ones) and reports them.  ``pad_to_multiple_of`` must equal the collate's
    (``make_collate`` does that): the budget and the report count padded slots with it.
    """

    batch_size: int | None = None
    max_tokens: int | None = None
    # 16k ids: measured 6 % padding on lognormal lengths (sigma 1) against 15 % at 4k; the
    # window holds only ids and lengths, and batches still mix the whole window.
    window: int = 16_384
    drop_last: bool = False
    pad_to_multiple_of: int = 1
    needs_lengths = True

    def __post_init__(self) -> None:
        _positive("pad_to_multiple_of", self.pad_to_multiple_of)
        if (self.batch_size is None) == (self.max_tokens is None):
            raise UsageError("BucketBatches takes exactly one of batch_size= or max_tokens=")
        _positive("batch_size", self.batch_size, optional=True)
        _positive("max_tokens", self.max_tokens, optional=True)
        _positive("window", self.window)
        if self.max_tokens is not None and self.drop_last:
            raise UsageError("drop_last applies to batch_size=; token-budget batches vary in size")

    def plan(
        self, order: np.ndarray, lengths: np.ndarray | None, rng: np.random.Generator
    ) -> list[np.ndarray]:
        if self.max_tokens is not None:
            return self._budget.plan(order, lengths, rng)
        ids = _ids(order)
        lens = _lengths_of(type(self).__name__, ids, lengths)
        bs = self.batch_size
        assert bs is not None
        if self.drop_last:
            keep = ids.size - ids.size % bs
            ids, lens = ids[:keep], lens[:keep]
        window = -(-self.window // bs) * bs
        batches: list[np.ndarray] = []
        for s in range(0, ids.size, window):
            w_ids = ids[s : s + window][np.argsort(lens[s : s + window], kind="stable")]
            batches += [w_ids[a : a + bs] for a in range(0, w_ids.size, bs)]
        return _shuffled(batches, rng)

    @property
    def _budget(self) -> TokenBudgetBatches:
        assert self.max_tokens is not None
        return TokenBudgetBatches(
            self.max_tokens, window=self.window, pad_to_multiple_of=self.pad_to_multiple_of
        )

    def report(
        self, order: np.ndarray, lengths: np.ndarray | None, batches: Sequence[np.ndarray]
    ) -> PlanReport:
        return account(order, lengths, batches, pad_to_multiple_of=self.pad_to_multiple_of)

    def resolve_collate(self, collate_fn: Any, field: str | None) -> Any:
        """The dataset's collate: ``collate_fn`` if a PadCollate pads as this plan counts
        (and truncates nothing the report would miss); any other callable as given."""
        from shardloader.collate import PadCollate

        if isinstance(collate_fn, PadCollate):
            _disagree(
                collate_fn,
                self,
                [
                    ("pad_to_multiple_of", self.pad_to_multiple_of, collate_fn.pad_to_multiple_of),
                    ("max_length", None, collate_fn.max_length),
                ],
            )
        return collate_fn

    def make_collate(self, pad_values: dict[str, int | float], **options: object) -> PadCollate:
        from shardloader.collate import PadCollate

        return PadCollate(
            pad_values, pad_to_multiple_of=self.pad_to_multiple_of, **options  # type: ignore[arg-type]
        )


# ---------------------------------------------------------------------------------------------
# sequence packing

Segment = tuple[int, int, int]  # (item position in the batch, token start, token stop)


def pack_rows(lengths: Sequence[int] | np.ndarray, seq_len: int) -> list[list[Segment]]:
    """First-fit of items, in the given order, into rows of ``seq_len`` tokens.

    An item of length ``<= seq_len`` goes whole into the first row (in creation order) with
    room, else into a new row.  A longer one is split: each full ``seq_len`` piece fills a new
    row, and its remainder starts another new row that later items may share.  Returns the
    rows in creation order, each a list of ``(item, start, stop)`` segments.

    NOTE: this is *the* packing rule.  :class:`PackedBatches` runs it over a window of
    segments (none longer than ``seq_len``) and :class:`~shardloader.collate.PackCollate`
    re-runs it over one batch's segments in batch order; first-fit restricted to a closed
    subset of rows, visited in the same relative order, places every item in the same row, so
    both agree (tested).  Only rows with room are scanned (a zero-length item goes to the
    first row of all, as first-fit says), so a window of many full pieces stays linear.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    rows: list[list[Segment]] = []
    open_row: list[int] = []  # rows with room left, in creation order
    open_room = np.empty(max(int(lens.size), 1), np.int64)  # their free tokens (a prefix)
    for item, length in enumerate(lens.tolist()):
        if length > seq_len:
            full = length // seq_len
            rows.extend([(item, p * seq_len, (p + 1) * seq_len)] for p in range(full))
            if length > full * seq_len:
                open_room[len(open_row)] = (full + 1) * seq_len - length
                open_row.append(len(rows))
                rows.append([(item, full * seq_len, length)])
            continue
        if length == 0 and rows:
            rows[0].append((item, 0, 0))
            continue
        n_open = len(open_row)
        if n_open:
            fits = open_room[:n_open] >= length
            k = int(fits.argmax())
            if fits[k]:
                rows[open_row[k]].append((item, 0, length))
                left = int(open_room[k]) - length
                open_room[k] = left
                if not left:  # full: never a candidate again
                    open_room[k : n_open - 1] = open_room[k + 1 : n_open]
                    del open_row[k]
                continue
        if length < seq_len:
            open_room[n_open] = seq_len - length
            open_row.append(len(rows))
        rows.append([(item, 0, length)])
    return rows


@dataclass(frozen=True)
class PackedBatches:
    """Sequence packing: documents cut into segments, packed into ``rows_per_batch`` rows of
    ``seq_len`` tokens per batch; every batch is ``[rows_per_batch, seq_len]``.

    A document longer than ``seq_len`` follows ``long_docs``: ``"split"`` (default) cuts it
    into ``seq_len`` pieces plus a remainder, each an independent segment that may land in any
    batch, so no token is lost; ``"truncate"`` keeps its first ``seq_len`` tokens; ``"drop"``
    leaves it out (both reported).  Per window of ``window`` documents of the order (plus the
    segments carried over), segments are sorted longest first (stable) and placed with
    :func:`pack_rows` (first-fit decreasing); consecutive rows form batches of exactly
    ``rows_per_batch`` rows, and the segments of an incomplete last batch are carried into the
    next window.  Each batch is a ``[k, 3]`` segment array (see the module's NOTE) in placement
    order, so :class:`~shardloader.collate.PackCollate` rebuilds exactly its planned rows.
    Batches are shuffled with ``rng`` at the end.

    ``tail`` (segments left after the last window, fewer than ``rows_per_batch`` rows):
    ``"keep"`` (default; one short batch, which the collate fills up with empty rows) or
    ``"drop"`` (reported).  ``pad_id`` (the tokenizer's pad id) lets the dataset build the
    collate itself (``make_collate``), so the two cannot disagree.
    """

    seq_len: int
    rows_per_batch: int
    window: int = _DEFAULT_WINDOW
    long_docs: str = "split"
    tail: str = "keep"
    pad_id: int | None = None
    needs_lengths = True

    def __post_init__(self) -> None:
        _positive("seq_len", self.seq_len)
        _positive("rows_per_batch", self.rows_per_batch)
        _positive("window", self.window)
        _choice("long_docs", self.long_docs, LONG_DOC_POLICIES)
        _choice("tail", self.tail, TAIL_POLICIES)
        if self.pad_id is not None and (
            not isinstance(self.pad_id, (int, np.integer)) or isinstance(self.pad_id, bool)
        ):
            raise UsageError(f"pad_id must be the tokenizer's integer pad id, got {self.pad_id!r}")

    def segments(self, order: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
        """``[n, 3]`` segments of the order's documents after ``long_docs``, in order."""
        ids = _ids(order)
        lens = _lengths_of(type(self).__name__, ids, lengths)
        return self._segments(ids, lens)[0]

    def _segments(self, ids: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Segments of ``ids`` and, per document, the offset of its first segment (+ the end)."""
        s = self.seq_len
        if self.long_docs == "drop":
            keep = lens <= s
            ids, lens = ids[keep], lens[keep]
        if self.long_docs == "split":
            pieces = np.maximum(-(-lens // s), 1)  # an empty document is one empty segment
        else:
            pieces = np.ones(lens.size, np.int64)
            lens = np.minimum(lens, s)
        offsets = np.zeros(ids.size + 1, np.int64)
        np.cumsum(pieces, out=offsets[1:])
        doc = np.repeat(np.arange(ids.size), pieces)
        start = (np.arange(doc.size) - offsets[doc]) * s
        stop = np.minimum(start + s, lens[doc])
        return np.stack([ids[doc], start, stop], axis=1), offsets

    def plan(
        self, order: np.ndarray, lengths: np.ndarray | None, rng: np.random.Generator
    ) -> list[np.ndarray]:
        ids = _ids(order)
        lens = _lengths_of(type(self).__name__, ids, lengths)
        if self.long_docs == "drop":
            keep = lens <= self.seq_len
            ids, lens = ids[keep], lens[keep]
        segs, offsets = self._segments(ids, lens)
        batches: list[np.ndarray] = []
        carry = np.empty((0, 3), np.int64)
        for s in range(0, ids.size, self.window):
            stop = min(s + self.window, ids.size)
            window = np.concatenate([carry, segs[offsets[s] : offsets[stop]]])
            full, carry = self._pack_window(window, flush=stop == ids.size and self.tail == "keep")
            batches += full  # what is still carried after the last window is the dropped tail
        return _shuffled(batches, rng)

    def _pack_window(self, segs: np.ndarray, *, flush: bool) -> tuple[list[np.ndarray], np.ndarray]:
        """Pack one window of segments; return its complete batches and the segments left."""
        by_len = np.argsort(segs[:, 1] - segs[:, 2], kind="stable")  # longest first
        segs = segs[by_len]
        rows = pack_rows(segs[:, 2] - segs[:, 1], self.seq_len)
        row_of = np.empty(len(segs), np.int64)
        for r, row in enumerate(rows):
            for item, _, _ in row:
                row_of[item] = r
        batch_of = row_of // self.rows_per_batch
        complete = len(rows) // self.rows_per_batch
        emit = -(-len(rows) // self.rows_per_batch) if flush else complete
        placement = np.argsort(batch_of, kind="stable")  # by batch, then placement order
        bounds = np.searchsorted(batch_of[placement], np.arange(emit + 1))
        out = [segs[placement[bounds[b] : bounds[b + 1]]] for b in range(emit)]
        return out, segs[batch_of >= emit]

    def report(
        self, order: np.ndarray, lengths: np.ndarray | None, batches: Sequence[np.ndarray]
    ) -> PlanReport:
        ids = _ids(order)
        _lengths_of(type(self).__name__, ids, lengths)  # validates
        return account(order, lengths, batches, row_shape=(self.rows_per_batch, self.seq_len))

    def make_collate(
        self, pad_id: int | None = None, field: str = "tokens", **options: object
    ) -> PackCollate:
        """A PackCollate with this plan's ``seq_len``, ``rows_per_batch`` and long-doc rule;
        ``pad_id`` defaults to the planner's."""
        from shardloader.collate import PackCollate

        pad = self.pad_id if pad_id is None else pad_id
        if pad is None:
            raise UsageError(
                "PackedBatches.make_collate needs the tokenizer's pad id: pass pad_id= here or "
                "to PackedBatches"
            )
        return PackCollate(
            self.seq_len,
            pad,
            field=field,
            rows_per_batch=self.rows_per_batch,
            long_docs=self.long_docs,
            **options,  # type: ignore[arg-type]
        )

    def resolve_collate(self, collate_fn: Any, field: str | None) -> Callable[..., Any]:
        """The dataset's collate for segment batches of ``field`` (the manifest's length field).

        None: made here (needs ``pad_id``).  A PackCollate: used if its options agree with the
        plan.  Any other callable: used as given; it gets one sample per segment.
        """
        from shardloader.collate import PackCollate

        if field is None:
            raise UsageError(
                "PackedBatches cuts documents by their recorded lengths, but the manifest names "
                "no length field; pack text with --tokenizer"
            )
        if collate_fn is None:
            if self.pad_id is None:
                raise UsageError(
                    "PackedBatches needs the tokenizer's pad id to build its collate: pass "
                    "PackedBatches(..., pad_id=...) (or collate_fn=planner.make_collate(pad_id))"
                )
            return self.make_collate(field=field)
        if isinstance(collate_fn, PackCollate):
            if collate_fn.field != field:
                raise UsageError(
                    f"PackCollate field={collate_fn.field!r} is not the field the plan cuts into "
                    f"segments ({field!r}, the manifest's length field); use field={field!r}"
                )
            pairs: list[tuple[str, Any, Any]] = [
                ("seq_len", self.seq_len, collate_fn.seq_len),
                ("rows_per_batch", self.rows_per_batch, collate_fn.rows_per_batch),
                ("long_docs", self.long_docs, collate_fn.long_docs),
            ]
            if self.pad_id is not None:
                pairs.append(("pad_id", self.pad_id, collate_fn.pad_id))
            _disagree(collate_fn, self, pairs)
        return collate_fn  # type: ignore[no-any-return]
