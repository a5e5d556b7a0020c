"""The collate of sequence packing: :class:`PackCollate` rebuilds the rows that
:class:`~shardloader.batching.packed.PackedBatches` planned, from the batch alone, with the same
placement rule (:func:`~shardloader.batching.fit.pack_rows`; NOTE [planner and collate agree
without talking] in :mod:`shardloader.batching.base`).  :func:`fill_fields`, which makes a
row's labels, positions and mask from its ids, is TokenBlocks' rule as well.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardloader.batching.base import (
    FIT_POLICIES,
    LONG_DOC_POLICIES,
    check_choice,
    check_pad_id,
    check_positive,
)
from shardloader.batching.fit import next_fit_rows, pack_rows
from shardloader.errors import UsageError

__all__ = ["IGNORE_INDEX", "PackCollate", "fill_fields"]

IGNORE_INDEX = -100  # label value torch's cross_entropy ignores by default


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
        check_pad_id(self.pad_id, optional=False)
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
        flat = ids.reshape(-1)
        starts, padded = [], []
        for r in range(n_rows):
            col = r * s
            for doc, start, stop in rows[r] if r < len(rows) else ():
                if stop > start:
                    starts.append(col)
                    flat[col : col + stop - start] = docs[doc][start:stop]
                    col += stop - start
            if col < (r + 1) * s:
                starts.append(col)
                padded.append((r, col - r * s))
        labels, pos, mask = (np.empty_like(ids) for _ in range(3))
        fill_fields((ids, labels, pos, mask), np.asarray(starts, np.int64), padded)
        cu = np.asarray([*starts, n_rows * s], np.int32)
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


def fill_fields(
    block: Sequence[np.ndarray] | np.ndarray, starts: np.ndarray, padded: list[tuple[int, int]]
) -> None:
    """Make ``labels``, ``position_ids`` and ``attention_mask`` of packed rows from their
    ``input_ids``: ``block`` is the four int64 ``[..., S]`` arrays in that order, ids filled;
    ``starts`` every segment start in the flattened rows, sorted (each row's start and its
    padding's start included); ``padded``: ``(row, real tokens)`` of each row with padding.
    Positions restart at every start; labels are the ids with -100 at every start and on
    padding; the mask is 0 on padding.  PackCollate and TokenBlocks both build their rows so."""
    ids, labels, pos, mask = block
    s = ids.shape[-1]
    size = ids.size
    seg = np.diff(starts, append=size)
    np.subtract(_arange(size), np.repeat(starts, seg), out=pos.reshape(-1))
    np.copyto(labels, ids)
    labels.reshape(-1)[starts] = IGNORE_INDEX
    mask.fill(1)
    for array, value in ((labels, IGNORE_INDEX), (mask, 0)) if padded else ():
        view = array.reshape(-1, s)
        for row, n in padded:
            view[row, n:] = value


_ARANGE = np.arange(0, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """``arange(n)`` int64 from a cached array (every batch needs one)."""
    global _ARANGE
    if _ARANGE.size < n:
        _ARANGE = np.arange(n, dtype=np.int64)
    return _ARANGE[:n]
