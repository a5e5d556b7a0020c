"""Sequence packing: :class:`PackedBatches` plans rows of documents, :class:`PackCollate`
builds them, and :func:`~shardloader.batching.fit.pack_rows` is the one placement rule both
run (:mod:`shardloader.batching.fit` holds it with the other placement rules).

A document of any length loses no token: the plan cuts long ones into segments (NOTE [what a
batch is] in :mod:`shardloader.batching.base`), and the collate re-derives every row from the
batch alone (NOTE [planner and collate agree without talking]).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardloader.batching.balance import BALANCE_POLICIES, pack_balanced, shuffled_steps
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
    check_positive,
    lengths_of,
    refuse_disagreement,
    shuffled,
    stable_value,
)
from shardloader.batching.fit import Segment, next_fit_rows, pack_rows, pack_window
from shardloader.errors import UsageError

__all__ = ["PackedBatches", "PackCollate", "pack_rows", "Segment", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # label value torch's cross_entropy ignores by default


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
        if self.pad_id is not None and (
            not isinstance(self.pad_id, (int, np.integer)) or isinstance(self.pad_id, bool)
        ):
            raise UsageError(f"pad_id must be the tokenizer's integer pad id, got {self.pad_id!r}")

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
        offsets = np.zeros(ids.size + 1, np.int64)
        np.cumsum(pieces, out=offsets[1:])
        doc = np.repeat(np.arange(ids.size), pieces)
        start = (np.arange(doc.size) - offsets[doc]) * s
        stop = np.minimum(start + s, lens[doc])
        return np.stack([ids[doc], start, stop], axis=1), offsets

    def signature(self) -> str:
        """NOTE [plan signature]: ``fit`` is written only when it is not the default, so states
        saved before it existed still load."""
        names = ("seq_len", "rows_per_batch", "window", "long_docs", "tail", "pad_id")
        fields = [f"{n}={stable_value(getattr(self, n))}" for n in names]
        if self.fit != "first":
            fields.append(f"fit={stable_value(self.fit)}")
        if self.balance is not None:
            for n in ("balance", "ranks", "balance_c"):
                fields.append(f"{n}={stable_value(getattr(self, n))}")
        return f"{type(self).__name__}({', '.join(fields)})"

    def plan(
        self, order: np.ndarray, lengths: np.ndarray | None, rng: np.random.Generator
    ) -> list[np.ndarray]:
        ids = as_ids(order)
        lens = lengths_of(type(self).__name__, ids, lengths)
        if self.long_docs == "drop":
            keep = lens <= self.seq_len
            ids, lens = ids[keep], lens[keep]
        segs, offsets = self._segments(ids, lens)
        bounds = offsets[np.minimum(np.arange(0, ids.size + self.window, self.window), ids.size)]
        return self._shuffled(self._pack(segs, np.unique(bounds)), rng)

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
        n = len(segs)
        bounds = np.unique(np.minimum(np.arange(0, n + self.window, self.window), n))
        return self._shuffled(self._pack(segs, bounds), rng)

    def _shuffled(self, batches: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
        if self.balance is not None and self.ranks is not None:
            return shuffled_steps(batches, self.ranks, rng)  # a step's batches stay together
        return shuffled(batches, rng)

    def _pack(self, segs: np.ndarray, bounds: np.ndarray) -> list[np.ndarray]:
        """Pack ``segs[bounds[i]:bounds[i + 1]]`` window by window, carrying what does not
        fill a batch into the next one."""
        if self.balance is not None and self.ranks is not None:  # NOTE [balanced steps]
            return pack_balanced(
                segs, bounds, self.seq_len, self.rows_per_batch, self.ranks, self.fit,
                float(self.balance_c), self.tail == "keep",
            )  # fmt: skip
        batches: list[np.ndarray] = []
        carry = np.empty((0, 3), np.int64)
        last = len(bounds) - 2
        for w in range(last + 1):
            window = np.concatenate([carry, segs[bounds[w] : bounds[w + 1]]])
            flush = w == last and self.tail == "keep"
            full, carry = pack_window(window, self.seq_len, self.rows_per_batch, self.fit, flush)
            batches += full  # what is still carried after the last window is the dropped tail
        return batches

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
                "PackedBatches.make_collate needs the tokenizer's pad id: pass pad_id= here or "
                "to PackedBatches"
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
                ("fit", self.fit, collate_fn.fit),
            ]
            if self.pad_id is not None:
                pairs.append(("pad_id", self.pad_id, collate_fn.pad_id))
            refuse_disagreement(collate_fn, self, pairs)
        return collate_fn  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------
# the collate


@dataclass(frozen=True)
class PackCollate:
    """Packs a batch of token documents (or segments of them) into rows of ``seq_len`` tokens.

    The items (field ``field`` of each sample, or bare arrays) are placed in batch order by
    :func:`pack_rows`, the rule :class:`PackedBatches`
    planned with, so a planned batch of segments fills exactly its planned rows.  Build it with
    ``PackedBatches.make_collate`` (or let the dataset do it): the dataset refuses a PackCollate
    whose ``seq_len``, ``rows_per_batch``, ``long_docs`` or ``field`` disagree with the plan.
    Used on its own with whole documents, ``long_docs`` says what happens to one longer than
    ``seq_len``: ``"split"`` cuts it into pieces over several rows, ``"truncate"`` keeps its
    first ``seq_len`` tokens, ``"drop"`` treats it as an error.  Nothing is cut silently: items
    that need more than ``rows_per_batch`` rows are an error.  ``fit="best"`` reads a batch
    that lists its rows one after another, as ``PackedBatches(fit="best")`` plans them: a row
    ends where the next item does not fit (:func:`~shardloader.batching.fit.next_fit_rows`).

    Output (R rows; R = ``rows_per_batch`` when set, padding with empty rows, else as many as
    needed):

    * ``input_ids`` int64 [R, seq_len], ``pad_id`` after each row's segments;
    * ``labels`` int64 [R, seq_len]: the input ids, *unshifted* (the model shifts, as Hugging
      Face causal LMs do: logits at t are scored against ``labels[t + 1]``), with ``-100`` at
      padding and at the first token of every segment (document or piece), so no position
      learns to predict across a document boundary;
    * ``position_ids`` int64 [R, seq_len]: 0, 1, ... restarting at every segment, and at the
      start of each row's padding run;
    * ``attention_mask`` int64 [R, seq_len]: 1 for real tokens, 0 for padding (documents are
      kept apart by ``cu_seqlens``/``position_ids``, not by this mask);
    * ``cu_seqlens`` int32 [segments + 1]: segment boundaries in the flattened
      ``input_ids.view(-1)`` (flash-attn varlen format); each row's padding run is a segment of
      its own, so ``cu_seqlens[-1] == R * seq_len``; ``max_seqlen``: int, longest segment;
    * other sample fields as per-item lists in batch order (e.g. ``__key__``, and
      ``__span__`` = (start, stop) of each segment the dataset cut).
    """

    seq_len: int
    pad_id: int
    field: str = "tokens"
    rows_per_batch: int | None = None
    long_docs: str = "split"
    fit: str = "first"

    def __post_init__(self) -> None:
        check_positive("seq_len", self.seq_len)
        check_choice("fit", self.fit, FIT_POLICIES)
        if not isinstance(self.pad_id, (int, np.integer)) or isinstance(self.pad_id, bool):
            raise UsageError(f"pad_id must be the tokenizer's integer pad id, got {self.pad_id!r}")
        check_positive("rows_per_batch", self.rows_per_batch, optional=True)
        check_choice("long_docs", self.long_docs, LONG_DOC_POLICIES)

    def _documents(self, samples: Sequence[Any]) -> tuple[list[np.ndarray], dict[str, list]]:
        docs: list[np.ndarray] = []
        rest: dict[str, list] = {}
        for i, s in enumerate(samples):
            value = s
            if isinstance(s, Mapping):
                if self.field not in s:
                    raise UsageError(
                        f"sample {i} has no field {self.field!r} (fields: {', '.join(s)}); pass "
                        "PackCollate(field=...) naming the token field"
                    )
                value = s[self.field]
                for k, v in s.items():
                    if k != self.field:
                        rest.setdefault(k, []).append(v)
            try:
                a = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            except (TypeError, ValueError) as err:  # ragged nested lists
                raise UsageError(
                    f"sample {i}: {self.field!r} must be a 1-D integer token array ({err})"
                ) from err
            if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                raise UsageError(
                    f"sample {i}: {self.field!r} must be a 1-D integer token array, "
                    f"got {a.dtype}{a.shape}: PackedBatches packs token ids, so re-pack text "
                    "with --tokenizer tokenizer.json, or records that hold token ids with "
                    "--token-field input_ids"
                )
            docs.append(a)
        return docs, rest

    def __call__(self, samples: Sequence[Any]) -> dict[str, Any]:
        docs, rest = self._documents(samples)
        if self.long_docs == "drop":
            long = [i for i, d in enumerate(docs) if d.size > self.seq_len]
            if long:
                raise UsageError(
                    f"document {long[0]} of the batch has {docs[long[0]].size} tokens > "
                    f"seq_len={self.seq_len}, but long_docs='drop' means the planner should "
                    "have dropped it; build the collate with PackedBatches.make_collate()"
                )
        if self.long_docs == "truncate":
            docs = [d[: self.seq_len] for d in docs]
        place = pack_rows if self.fit == "first" else next_fit_rows
        rows = place([d.size for d in docs], self.seq_len)
        n_rows = len(rows)
        if self.rows_per_batch is not None:
            if n_rows > self.rows_per_batch:
                raise UsageError(
                    f"the batch's documents need {n_rows} rows of {self.seq_len} tokens, more "
                    f"than rows_per_batch={self.rows_per_batch}: plan the batches with "
                    "PackedBatches (it cuts long documents into segments that fit), and build "
                    "this collate with PackedBatches.make_collate()"
                )
            n_rows = self.rows_per_batch
        s = self.seq_len
        ids = np.full((n_rows, s), self.pad_id, np.int64)
        labels = np.full((n_rows, s), IGNORE_INDEX, np.int64)
        pos = np.zeros((n_rows, s), np.int64)
        mask = np.zeros((n_rows, s), np.int64)
        bounds = [0]
        for r in range(n_rows):
            col = 0
            for doc, start, stop in rows[r] if r < len(rows) else ():
                n = stop - start
                if not n:
                    continue
                ids[r, col : col + n] = docs[doc][start:stop]
                labels[r, col + 1 : col + n] = ids[r, col + 1 : col + n]
                pos[r, col : col + n] = np.arange(n)
                mask[r, col : col + n] = 1
                col += n
                bounds.append(r * s + col)
            if col < s:
                pos[r, col:] = np.arange(s - col)
                bounds.append((r + 1) * s)
        cu = np.asarray(bounds, np.int32)
        out: dict[str, Any] = dict(rest)
        out.update(
            input_ids=torch.from_numpy(ids),
            labels=torch.from_numpy(labels),
            position_ids=torch.from_numpy(pos),
            attention_mask=torch.from_numpy(mask),
            cu_seqlens=torch.from_numpy(cu),
            max_seqlen=int(np.diff(cu).max()) if cu.size > 1 else 0,
        )
        return out
