"""Sequence packing: :class:`PackedBatches` plans rows of documents,
:class:`~shardloader.batching.packcollate.PackCollate` builds them, and
:func:`~shardloader.batching.fit.pack_rows` is the one placement rule both run
(:mod:`shardloader.batching.fit` holds it with the other placement rules).

A document of any length loses no token: the plan cuts long ones into segments (NOTE [what a
batch is] in :mod:`shardloader.batching.base`), and the collate re-derives every row from the
batch alone (NOTE [planner and collate agree without talking]).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.batching.balance import BALANCE_POLICIES, pack_window_balanced, shuffled_steps
from shardloader.batching.base import (
    DEFAULT_WINDOW,
    FIT_POLICIES,
    LONG_DOC_POLICIES,
    TAIL_POLICIES,
    BatchPlanner,
    PlanReport,
    account,
    as_ids,
    check_choice,
    check_pad_id,
    check_positive,
    lengths_of,
    refuse_disagreement,
    shuffled,
    stable_value,
)
from shardloader.batching.fit import Segment, pack_rows, pack_window
from shardloader.batching.packcollate import IGNORE_INDEX, PackCollate
from shardloader.errors import UsageError

__all__ = ["PackedBatches", "PackCollate", "pack_rows", "Segment", "IGNORE_INDEX"]


@dataclass(frozen=True)
class PackedBatches(BatchPlanner):
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
    order, so :class:`PackCollate` rebuilds exactly its planned rows.
    Batches are shuffled with ``rng`` at the end.

    ``tail`` (segments left after the last window, fewer than ``rows_per_batch`` rows):
    ``"keep"`` (default; one short batch, which the collate fills up with empty rows) or
    ``"drop"`` (reported).  ``pad_id`` (the tokenizer's pad id) lets the dataset build the
    collate itself (``make_collate``), so the two cannot disagree.

    ``fit`` is how a window's segments (longest first) find their rows: ``"first"``
    (default, first-fit decreasing: the first row with room) or ``"best"`` (best-fit
    decreasing: the row with the least room that holds the segment; a window where first-fit
    needs fewer rows keeps first-fit's rows, so best-fit never makes more rows of a window).
    A ``"best"`` batch lists its rows one after another and its collate reads them so
    (NOTE [best-fit rows are listed, not re-derived] in :mod:`shardloader.batching.fit`).
    No mode cuts a document that fits in a row: with ``long_docs="truncate"`` or ``"drop"``
    no document ever crosses rows (the no-split mode; what it cuts is reported).

    ``balance="attention"`` plans each step's ``ranks`` batches together (``ranks``: the
    data-parallel ranks that share a step, those of one node partition) so that its dearest
    batch costs little more than the mean, a row's cost being ``sum(L**2) + balance_c *
    sum(L)`` over its segments (NOTE [balanced steps] in :mod:`shardloader.batching.balance`);
    batches are then shuffled in whole steps.

    A resume may change ``rows_per_batch`` (``elastic``): the rest of the epoch's segments are
    re-planned for the new batch shape (:meth:`plan_segments`).
    """

    seq_len: int
    rows_per_batch: int
    window: int = DEFAULT_WINDOW
    long_docs: str = "split"
    tail: str = "keep"
    pad_id: int | None = None
    fit: str = "first"
    balance: str | None = None
    ranks: int | None = None
    balance_c: float = 0.0
    needs_lengths = True
    elastic = "rows_per_batch"

    def __post_init__(self) -> None:
        check_positive("seq_len", self.seq_len)
        check_positive("rows_per_batch", self.rows_per_batch)
        check_positive("window", self.window)
        check_choice("long_docs", self.long_docs, LONG_DOC_POLICIES)
        check_choice("tail", self.tail, TAIL_POLICIES)
        check_choice("fit", self.fit, FIT_POLICIES)
        check_choice("balance", self.balance, BALANCE_POLICIES)  # type: ignore[arg-type]
        if self.balance is not None:
            check_positive("ranks", self.ranks)
            c = self.balance_c
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < math.inf:
                raise UsageError(f"balance_c must be a finite number >= 0, got {c!r}")
        elif self.ranks is not None:
            raise UsageError(
                f"ranks={self.ranks!r} is read only with balance='attention' (it says how many "
                "ranks share a step); pass both or neither"
            )
        check_pad_id(self.pad_id)

    def segments(self, order: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
        """``[n, 3]`` segments of the order's documents after ``long_docs``, in order."""
        ids = as_ids(order)
        lens = lengths_of(type(self).__name__, ids, lengths)
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
        offsets = np.concatenate([[0], np.cumsum(pieces)])
        doc = np.repeat(np.arange(ids.size), pieces)
        start = (np.arange(doc.size) - offsets[doc]) * s
        stop = np.minimum(start + s, lens[doc])
        return np.stack([ids[doc], start, stop], axis=1), offsets

    def signature(self) -> str:
        """NOTE [plan signature]: ``fit`` is written only when it is not the default, so states
        saved before it existed still load."""
        names = ["seq_len", "rows_per_batch", "window", "long_docs", "tail", "pad_id"]
        names += ["fit"] if self.fit != "first" else []
        names += ["balance", "ranks", "balance_c"] if self.balance is not None else []
        fields = ", ".join(f"{n}={stable_value(getattr(self, n))}" for n in names)
        return f"{type(self).__name__}({fields})"

    def plan(
        self, order: np.ndarray, lengths: np.ndarray | None, rng: np.random.Generator
    ) -> list[np.ndarray]:
        ids = as_ids(order)
        segs, offsets = self._segments(ids, lengths_of(type(self).__name__, ids, lengths))
        return self._pack(segs, offsets[self._windows(offsets.size - 1)], rng)

    def plan_segments(self, segments: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        """Batches of given segments ``[n, 3]`` (each at most ``seq_len`` tokens), windows of
        ``window`` segments: what is left of an epoch after an elastic resume (the segments
        an earlier batch shape did not deliver), packed for this one."""
        segs = np.asarray(segments, np.int64).reshape(-1, 3)
        if segs.size and int((segs[:, 2] - segs[:, 1]).max()) > self.seq_len:
            raise UsageError(
                f"a segment is longer than seq_len={self.seq_len}: the rest of an epoch can be "
                "re-planned only with the seq_len it was cut with"
            )
        return self._pack(segs, self._windows(len(segs)), rng)

    def _windows(self, n: int) -> np.ndarray:
        """Bounds ``0, window, 2 * window, ..., n`` of ``n`` documents (or segments)."""
        return np.unique(np.minimum(np.arange(0, n + self.window, self.window), n))

    def _pack(
        self, segs: np.ndarray, bounds: np.ndarray, rng: np.random.Generator
    ) -> list[np.ndarray]:
        """Pack ``segs[bounds[i]:bounds[i + 1]]`` window by window, carrying what does not
        fill a batch into the next one; the batches shuffled (a balanced step's together)."""
        n, rows = self.seq_len, self.rows_per_batch
        c, keep = float(self.balance_c), self.tail == "keep"
        batches: list[np.ndarray] = []
        carry = np.empty((0, 3), np.int64)
        last = len(bounds) - 2
        for w in range(last + 1):
            window = np.concatenate([carry, segs[bounds[w] : bounds[w + 1]]])
            if self.ranks is not None:  # balance="attention" (ranks is given exactly then)
                full, carry = pack_window_balanced(
                    window, n, rows, self.ranks, self.fit, c, w == last, keep
                )
            else:
                full, carry = pack_window(window, n, rows, self.fit, w == last and keep)
            batches += full  # what is still carried after the last window is the dropped tail
        if self.ranks is not None:  # NOTE [balanced steps]
            return shuffled_steps(batches, self.ranks, rng)
        return shuffled(batches, rng)

    def explain_dropped(self, tokens: int | None) -> str:
        """Why the plan left a document of ``tokens`` out (for the ledger)."""
        if self.long_docs == "drop" and tokens is not None and tokens > self.seq_len:
            return f"long_docs='drop': {tokens} tokens > seq_len={self.seq_len}"
        return "tail='drop': its segments were left after the last window, short of a batch"

    def explain_truncated(self, total: int, kept: int) -> str:
        """Why only ``kept`` of a document's ``total`` tokens are delivered (for the ledger)."""
        if self.long_docs == "truncate" and total > self.seq_len and kept == self.seq_len:
            return f"long_docs='truncate': its first {kept} of {total} tokens"
        return (
            f"{kept} of {total} tokens delivered: the rest lay in batches left out "
            "(tail='drop' or uneven='drop')"
        )

    def report(
        self, order: np.ndarray, lengths: np.ndarray | None, batches: Sequence[np.ndarray]
    ) -> PlanReport:
        ids = as_ids(order)
        lengths_of(type(self).__name__, ids, lengths)  # validates
        return account(order, lengths, batches, row_shape=(self.rows_per_batch, self.seq_len))

    def make_collate(
        self, pad_id: int | None = None, field: str = "tokens", **options: object
    ) -> PackCollate:
        """A PackCollate with this plan's ``seq_len``, ``rows_per_batch`` and long-doc rule;
        ``pad_id`` defaults to the planner's."""
        pad = self.pad_id if pad_id is None else pad_id
        if pad is None:
            raise UsageError(
                "PackedBatches needs the tokenizer's pad id to build its collate: pass "
                "PackedBatches(..., pad_id=...) or collate_fn=planner.make_collate(pad_id)"
            )
        return PackCollate(
            self.seq_len,
            pad,
            field=field,
            rows_per_batch=self.rows_per_batch,
            long_docs=self.long_docs,
            fit=self.fit,
            **options,  # type: ignore[arg-type]
        )

    def resolve_collate(self, collate_fn: Any, field: str | None) -> Callable[..., Any]:
        """The dataset's collate for segment batches of ``field`` (the manifest's length field).

        None: made here (needs ``pad_id``).  A PackCollate: used if its options agree with the
        plan.  Any other callable: used as given; it gets one sample per segment.
        """
        if field is None:
            raise UsageError(
                "PackedBatches cuts documents by their recorded lengths, but the manifest names "
                "no length field; re-pack text with --tokenizer tokenizer.json, or records that "
                "hold token ids with --token-field input_ids"
            )
        if collate_fn is None:
            return self.make_collate(field=field)  # needs pad_id
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
                ("fit", self.fit, collate_fn.fit),
            ]
            if self.pad_id is not None:
                pairs.append(("pad_id", self.pad_id, collate_fn.pad_id))
            refuse_disagreement(collate_fn, self, pairs)
        return collate_fn  # type: ignore[no-any-return]
