"""Batch planners: cut the epoch's global order into global batches.

A planner is a pure function of ``(order, lengths, rng)``: the same inputs give the same batches
in every process, whatever the world size or worker count (the dataset deals batch ``i`` to rank
``i mod W``).  Planners hold only frozen options, so they pickle into workers.

NOTE [planner and collate agree without talking]
    A batch crosses into a worker as bare sample ids.  Whatever the collate must know about the
    plan (padded length, truncation, the row of each packed document) is re-derived there from
    the samples themselves with the same function the planner used:
    :func:`padded_length` for bucketing and budgets, :func:`pack_rows` for packing.  Build the
    collate from the planner (``planner.make_collate(...)``) so their options match.

Every planner also has a pure ``report(order, lengths, batches) -> PlanReport`` that says what
its policies dropped, truncated or split, and how many padded tokens the batches cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

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
        """Return global batches (int64 sample ids); every id of ``order`` appears exactly
        once, except those a documented tail policy drops (see ``report``)."""
        ...


@dataclass(frozen=True)
class PlanReport:
    """What a plan delivers and what its policies cost; computed purely by ``report()``.

    ``tokens``/``padded_tokens`` are ``None`` when no lengths were given.  ``padded_tokens``
    counts the token slots the collate will allocate (real tokens plus padding).
    """

    num_samples: int  # ids in the order
    num_batches: int
    dropped: tuple[int, ...] = ()  # ids in no batch (tail or oversize policy)
    truncated: tuple[int, ...] = ()  # ids whose tokens the collate cuts
    split: tuple[int, ...] = ()  # packed documents spread over several rows
    tokens: int | None = None  # real tokens delivered (after truncation)
    padded_tokens: int | None = None

    @property
    def pad_fraction(self) -> float | None:
        """Share of allocated token slots that are padding."""
        if self.tokens is None or not self.padded_tokens:
            return None
        return 1.0 - self.tokens / self.padded_tokens


# ---------------------------------------------------------------------------------------------
# shared helpers


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


def _dropped(order: np.ndarray, batches: Sequence[np.ndarray]) -> tuple[int, ...]:
    delivered = np.concatenate(batches) if batches else np.empty(0, np.int64)
    return tuple(int(i) for i in np.setdiff1d(_ids(order), delivered))


def _padded_report(
    order: np.ndarray,
    lengths: np.ndarray | None,
    batches: Sequence[np.ndarray],
    *,
    max_length: int | None,
    pad_to_multiple_of: int,
) -> PlanReport:
    """Report for batches that PadCollate pads to their longest sample."""
    ids = _ids(order)
    common = {
        "num_samples": int(ids.size),
        "num_batches": len(batches),
        "dropped": _dropped(ids, batches),
    }
    if lengths is None:
        return PlanReport(**common)  # type: ignore[arg-type]
    lens = np.asarray(lengths, dtype=np.int64)
    tokens = padded = 0
    truncated: list[int] = []
    for batch in batches:
        b = lens[batch]
        if max_length is not None:
            truncated += [int(i) for i in batch[b > max_length]]
            b = np.minimum(b, max_length)
        tokens += int(b.sum())
        if b.size:
            padded += b.size * padded_length(int(b.max()), pad_to_multiple_of)
    return PlanReport(
        **common,  # type: ignore[arg-type]
        truncated=tuple(sorted(truncated)),
        tokens=tokens,
        padded_tokens=padded,
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
        return _padded_report(order, lengths, batches, max_length=None, pad_to_multiple_of=1)


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
        limit = self.max_length if self.oversize == "truncate" else None
        return _padded_report(
            order, lengths, batches, max_length=limit, pad_to_multiple_of=self.pad_to_multiple_of
        )

    def make_collate(self, pad_values: dict[str, int | float], **options: object) -> PadCollate:
        """A PadCollate whose padding and truncation match this plan's budget arithmetic."""
        from shardloader.collate import PadCollate

        max_length = self.max_length if self.oversize == "truncate" else None
        return PadCollate(
            pad_values,
            pad_to_multiple_of=self.pad_to_multiple_of,
            max_length=max_length,
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
    longest ones) and reports them.
    """

    batch_size: int | None = None
    max_tokens: int | None = None
    # 16k ids: measured 6 % padding on lognormal lengths (sigma 1) against 15 % at 4k; the
    # window holds only ids and lengths, and batches still mix the whole window.
    window: int = 16_384
    drop_last: bool = False
    needs_lengths = True

    def __post_init__(self) -> None:
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
            return TokenBudgetBatches(self.max_tokens, window=self.window).plan(order, lengths, rng)
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

    def report(
        self, order: np.ndarray, lengths: np.ndarray | None, batches: Sequence[np.ndarray]
    ) -> PlanReport:
        return _padded_report(order, lengths, batches, max_length=None, pad_to_multiple_of=1)

    def make_collate(self, pad_values: dict[str, int | float], **options: object) -> PadCollate:
        from shardloader.collate import PadCollate

        return PadCollate(pad_values, **options)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# sequence packing

Segment = tuple[int, int, int]  # (document position in the batch, token start, token stop)


def pack_rows(lengths: Sequence[int] | np.ndarray, seq_len: int) -> list[list[Segment]]:
    """First-fit of documents, in the given order, into rows of ``seq_len`` tokens.

    A document of length ``<= seq_len`` goes whole into the first row (in creation order) with
    room, else into a new row.  A longer one is split: each full ``seq_len`` piece fills a new
    row, and its remainder starts another new row that later documents may share.  Returns the
    rows in creation order, each a list of ``(doc, start, stop)`` segments.

    NOTE: this is *the* packing rule.  :class:`PackedBatches` runs it over a window and
    :class:`~shardloader.collate.PackCollate` re-runs it over one batch's documents in batch
    order; first-fit restricted to a closed subset of rows, visited in the same relative order,
    places every document in the same row, so both agree (tested).
    """
    lens = np.asarray(lengths, dtype=np.int64)
    capacity = int(lens.size + (lens // seq_len).sum()) if lens.size else 0
    room = np.zeros(capacity, np.int64)  # free tokens per row
    rows: list[list[Segment]] = []
    for doc, length in enumerate(lens.tolist()):
        if length > seq_len:
            full = length // seq_len
            for p in range(full):
                rows.append([(doc, p * seq_len, (p + 1) * seq_len)])
            rest = length - full * seq_len
            if rest:
                room[len(rows)] = seq_len - rest
                rows.append([(doc, full * seq_len, length)])
            continue
        if rows:
            fits = room[: len(rows)] >= length
            r = int(fits.argmax())
            if fits[r]:
                rows[r].append((doc, 0, length))
                room[r] -= length
                continue
        room[len(rows)] = seq_len - length
        rows.append([(doc, 0, length)])
    return rows


@dataclass(frozen=True)
class PackedBatches:
    """Sequence packing: whole documents into rows of ``seq_len`` tokens, ``rows_per_batch``
    rows per batch.

    Per window of ``window`` ids (plus documents carried from the previous window), documents
    are sorted longest first (stable) and placed with :func:`pack_rows` (first-fit decreasing);
    the rows are grouped into batches of exactly ``rows_per_batch`` rows, and documents of an
    incomplete batch are carried into the next window.  Each batch lists its documents in
    placement order, so :class:`~shardloader.collate.PackCollate` rebuilds the same rows from
    the batch alone.  Batches are shuffled with ``rng`` at the end.

    ``long_docs`` (documents longer than ``seq_len``): ``"split"`` (default) over consecutive
    rows of one batch (documents longer than ``rows_per_batch * seq_len`` are truncated to that;
    both reported), ``"truncate"`` to ``seq_len`` (reported) or ``"drop"`` (reported).
    ``tail`` (documents left in incomplete batches after the last window): ``"keep"``
    (default; short batches, usually one, which the collate pads with empty rows when given
    ``rows_per_batch``) or ``"drop"`` (reported).  Batch counts depend only on the plan, never
    on world size; the dataset evens them out across ranks.
    """

    seq_len: int
    rows_per_batch: int
    window: int = _DEFAULT_WINDOW
    long_docs: str = "split"
    tail: str = "keep"
    needs_lengths = True

    def __post_init__(self) -> None:
        _positive("seq_len", self.seq_len)
        _positive("rows_per_batch", self.rows_per_batch)
        _positive("window", self.window)
        _choice("long_docs", self.long_docs, LONG_DOC_POLICIES)
        _choice("tail", self.tail, TAIL_POLICIES)

    @property
    def max_doc_tokens(self) -> int:
        """Longest document (after truncation) one batch holds under ``long_docs``."""
        if self.long_docs == "split":
            return self.seq_len * self.rows_per_batch
        return self.seq_len

    def effective_lengths(self, lens: np.ndarray) -> np.ndarray:
        """Token counts after the ``long_docs`` truncation (drop is handled by ``plan``)."""
        return np.minimum(np.asarray(lens, dtype=np.int64), self.max_doc_tokens)

    def plan(
        self, order: np.ndarray, lengths: np.ndarray | None, rng: np.random.Generator
    ) -> list[np.ndarray]:
        ids = _ids(order)
        lens = _lengths_of(type(self).__name__, ids, lengths)
        if self.long_docs == "drop":
            keep = lens <= self.seq_len
            ids, lens = ids[keep], lens[keep]
        lens = self.effective_lengths(lens)
        batches: list[np.ndarray] = []
        carry_ids = np.empty(0, np.int64)
        carry_lens = np.empty(0, np.int64)
        for s in range(0, ids.size, self.window):
            w_ids = np.concatenate([carry_ids, ids[s : s + self.window]])
            w_lens = np.concatenate([carry_lens, lens[s : s + self.window]])
            flush = s + self.window >= ids.size and self.tail == "keep"
            full, carry_ids, carry_lens = self._pack_window(w_ids, w_lens, flush=flush)
            batches += full  # what is still carried after the last window is the dropped tail
        return _shuffled(batches, rng)

    def _pack_window(
        self, ids: np.ndarray, lens: np.ndarray, *, flush: bool = False
    ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """Pack one window; return complete batches and the (ids, lens) of the rest."""
        by_len = np.argsort(-lens, kind="stable")
        ids, lens = ids[by_len], lens[by_len]
        rows = pack_rows(lens, self.seq_len)
        # a document's rows (one, or the consecutive pieces of a split one) form a group
        # that must stay in one batch; groups go first-fit into batches of rows_per_batch rows
        row_of_doc = np.empty(ids.size, np.int64)
        group_start: list[int] = []
        for r, row in enumerate(rows):
            first_doc, start, _ = row[0]
            if start == 0 or not group_start:
                group_start.append(r)
            for doc, start, _ in row:
                if start == 0:
                    row_of_doc[doc] = r
        starts = np.asarray(group_start + [len(rows)], np.int64)
        sizes = np.diff(starts)
        room = np.full(len(sizes), self.rows_per_batch, np.int64)
        batch_of_row = np.empty(len(rows), np.int64)
        nbatches = 0
        for g, size in enumerate(sizes.tolist()):
            fits = room[:nbatches] >= size
            b = int(fits.argmax()) if nbatches else 0
            if not nbatches or not fits[b]:
                b = nbatches
                nbatches += 1
            room[b] -= size
            batch_of_row[starts[g] : starts[g + 1]] = b
        batch_of_doc = batch_of_row[row_of_doc]
        complete = room[:nbatches] == 0
        placement = np.argsort(batch_of_doc, kind="stable")  # by batch, then placement order
        bounds = np.searchsorted(batch_of_doc[placement], np.arange(nbatches + 1))
        out = [
            ids[placement[bounds[b] : bounds[b + 1]]]
            for b in range(nbatches)
            if complete[b] or flush
        ]
        rest = ~complete[batch_of_doc]
        if flush:
            rest[:] = False
        return out, ids[rest], lens[rest]

    def report(
        self, order: np.ndarray, lengths: np.ndarray | None, batches: Sequence[np.ndarray]
    ) -> PlanReport:
        ids = _ids(order)
        _lengths_of(type(self).__name__, ids, lengths)  # validates
        whole = np.asarray(lengths, dtype=np.int64)
        eff = self.effective_lengths(whole)
        rows = sum(len(pack_rows(eff[b], self.seq_len)) for b in batches)
        delivered = np.concatenate(batches) if batches else np.empty(0, np.int64)
        truncated = delivered[whole[delivered] > self.max_doc_tokens]
        split = delivered[whole[delivered] > self.seq_len] if self.long_docs == "split" else ()
        return PlanReport(
            num_samples=int(ids.size),
            num_batches=len(batches),
            dropped=_dropped(ids, batches),
            truncated=tuple(sorted(int(i) for i in truncated)),
            split=tuple(sorted(int(i) for i in split)),
            tokens=int(eff[delivered].sum()),
            padded_tokens=rows * self.seq_len,
        )

    def make_collate(self, pad_id: int, **options: object) -> PackCollate:
        """A PackCollate with this plan's ``seq_len``, ``rows_per_batch`` and long-doc rule."""
        from shardloader.collate import PackCollate

        return PackCollate(
            self.seq_len,
            pad_id,
            rows_per_batch=self.rows_per_batch,
            long_docs=self.long_docs,
            **options,  # type: ignore[arg-type]
        )
