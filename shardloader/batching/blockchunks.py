"""Assembling token-block batches: the worker's hot path, numpy over whole chunks of batches.

:mod:`shardloader.batching.blocks` plans which rows make a batch (NOTE [what a row is]); this
module turns a chunk of those batches into the four ``[k, rows, seq_len]`` fields and their
``cu_seqlens`` without a Python loop per document, into the buffer that crosses to the main
process (:func:`build`: TokenBlocks' collate).  The pass (:mod:`shardloader.read.samplepass`)
calls it with the rows the token format loaded (:mod:`shardloader.format.tokens.rows`).
Labels, positions and the mask follow from the ids and the segment starts by the rule
PackCollate's rows follow too (:func:`~shardloader.batching.packcollate.fill_fields`).

NOTE [flagged repeats]
    Under ``uneven="pad"`` a rank whose partition has run out of batches repeats batches from
    the epoch's start, so every rank takes the same number of steps (DESIGN.md "Order and
    split", 4).  Those tokens were trained on once already.  Every token-block batch carries
    ``__pad__``, a bool ``[rows_per_batch]`` row flag (as sample batches carry one per
    sample): True for each row of a repeated batch and for each padding row a short last
    batch was filled up with.  A repeated row's ``labels`` are all -100
    (``TokenBlocks(repeat_labels="ignore")``, the default), so a loss with
    ``ignore_index=-100`` learns nothing from it twice; ``repeat_labels="keep"`` leaves them as
    the first delivery had them, flagged only.  Input ids, positions and the attention mask
    are unchanged: the step's shapes and its attention are what the first delivery had.
    Whether a step repeats is the plan's arithmetic (:meth:`~shardloader.plan.split.
    BatchSlots.repeats`), so every worker and rank flags the same rows, resumed or not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.batching.blocks import FIELDS, RowLayout
from shardloader.batching.packcollate import IGNORE_INDEX, fill_fields
from shardloader.deliver.transport import TokenBatches

if TYPE_CHECKING:
    from shardloader.batching.blocks import TokenBlocks

__all__ = ["FIELDS", "ChunkLayout", "assemble", "build", "chunk_layout", "copy_rows", "flag_rows"]


@dataclass(frozen=True)
class ChunkLayout:
    """The rows and segments of ``k`` batches that are assembled together.

    Slot ``b * rows_per_batch + i`` holds row ``i`` of batch ``b``: ``shard``, ``lo`` (start in
    the shard's stream) and ``n`` (real tokens; 0 for a row the last batch lacks; shard -1).
    ``starts`` are the segment starts in the chunk's flattened ``[k * rows_per_batch *
    seq_len]`` tokens (every row start, document starts inside rows, each row's padding start),
    sorted; ``cuts[b]`` is the index in ``starts`` of batch ``b``'s first segment (``cuts[k]``
    the end).  ``cu`` holds every batch's ``cu_seqlens`` one after the other (batch ``b``'s at
    ``cuts[b] + b``), ``max_seqlen`` each batch's longest segment.
    """

    k: int
    rows_per_batch: int
    seq_len: int
    shard: np.ndarray
    lo: np.ndarray
    n: np.ndarray
    starts: np.ndarray
    cuts: np.ndarray
    cu: np.ndarray
    max_seqlen: np.ndarray

    def part(self, b0: int, b1: int) -> ChunkLayout:
        """The layout of batches ``b0 .. b1 - 1`` alone (itself when that is all of them: a
        lean chunk is a whole span, NOTE [lean chunks], and its copies cost ~2 us a batch)."""
        if b0 == 0 and b1 == self.k:
            return self
        r, per = self.rows_per_batch, self.rows_per_batch * self.seq_len
        a, b = int(self.cuts[b0]), int(self.cuts[b1])
        return ChunkLayout(
            b1 - b0,
            r,
            self.seq_len,
            self.shard[b0 * r : b1 * r],
            self.lo[b0 * r : b1 * r],
            self.n[b0 * r : b1 * r],
            self.starts[a:b] - b0 * per,
            self.cuts[b0 : b1 + 1] - a,
            self.cu[a + b0 : b + b1],
            self.max_seqlen[b0:b1],
        )


def chunk_layout(lay: RowLayout, batches: list[np.ndarray], rows_per_batch: int) -> ChunkLayout:
    """Numpy over all rows of ``batches``: where each row's tokens are, where segments start,
    and each batch's ``cu_seqlens``."""
    s, k = lay.seq_len, len(batches)
    slots, per = k * rows_per_batch, rows_per_batch * lay.seq_len
    rows = np.concatenate(batches) if k else np.zeros(0, np.int64)
    sizes = np.fromiter((b.size for b in batches), np.int64, k)
    if int(sizes.sum()) == slots:
        slot = np.arange(slots, dtype=np.int64)
    else:  # a short last batch: its missing rows are padding
        first = np.repeat(
            np.arange(k, dtype=np.int64) * rows_per_batch - np.cumsum(sizes) + sizes, sizes
        )
        slot = first + np.arange(rows.size, dtype=np.int64)
    shard, lo, n = lay.windows(rows)
    g = lay.token_bases[shard] + lo
    first_doc = lay.inside[rows]
    count = lay.inside_end[rows] - first_doc
    parts = [np.arange(slots, dtype=np.int64) * s]
    total = int(count.sum())
    if total:
        of = np.repeat(np.arange(rows.size, dtype=np.int64), count)
        skip = np.repeat(first_doc - np.cumsum(count) + count, count)
        inside = lay.bounds[np.arange(total, dtype=np.int64) + skip]
        parts.append(inside - g[of] + slot[of] * s)
    short = (n < s) & (n > 0)
    if short.any():
        parts.append(slot[short] * s + n[short])
    starts = np.sort(np.concatenate(parts)) if len(parts) > 1 else parts[0]
    cuts = np.searchsorted(starts, np.arange(k + 1, dtype=np.int64) * per)
    seg = np.diff(starts, append=k * per)
    counts = np.diff(cuts)
    cu = np.empty(starts.size + k, np.int32)
    batch_of = np.repeat(np.arange(k, dtype=np.int64), counts)
    cu[np.arange(starts.size) + batch_of] = starts - batch_of * per
    cu[cuts[1:] + np.arange(k)] = per
    longest = np.maximum.reduceat(seg, cuts[:-1]) if k else np.zeros(0, np.int64)
    full_shard = np.full(slots, -1, np.int64)
    full_lo = np.zeros(slots, np.int64)
    full_n = np.zeros(slots, np.int64)
    full_shard[slot], full_lo[slot], full_n[slot] = shard, lo, n
    return ChunkLayout(k, rows_per_batch, s, full_shard, full_lo, full_n, starts, cuts, cu, longest)


def assemble(
    chunk: ChunkLayout, streams: dict[int, np.ndarray], block: np.ndarray, pad_id: int
) -> None:
    """Fill ``block`` (int64 ``[4, k, R, S]``: :data:`FIELDS` in order) for a chunk;
    ``streams[shard]`` is the shard's token array."""
    padded = copy_rows(chunk, streams, block[0], pad_id)
    fill_fields(block, chunk.starts, padded)


def copy_rows(
    chunk: ChunkLayout, streams: dict[int, np.ndarray], ids: np.ndarray, fill: int = 0
) -> list[tuple[int, int]]:
    """Fill a chunk's ``[k, R, S]`` ids with its rows' tokens, ``fill`` past each row's real
    tokens (a lean chunk, in the shards' dtype: 0, NOTE [lean batches] in
    :mod:`shardloader.batching.lean`); return ``(slot, real tokens)`` of each short row.

    A row starts at a multiple of ``seq_len`` in its shard's stream (NOTE [what a row is]),
    so a big chunk's full rows are gathered a shard at a time: one ``take`` from each stream
    seen as ``[rows, seq_len]`` into a buffer in shard order, then one scatter into place
    (measured, 512 rows of 2048 from 9 shards: 2.8 us a batch of 8 rows against 4.5 us row by
    row; at 64 rows row by row is faster)."""
    k, rows, s = ids.shape
    flat_rows = ids.reshape(k * rows, s)
    if k * rows < _GATHER_ROWS:
        return _copy_each(chunk, streams, flat_rows, range(k * rows), fill)
    full = chunk.n == s
    slots = np.flatnonzero(full)
    slots = slots[np.argsort(chunk.shard[slots], kind="stable")]  # by shard
    key, at = chunk.shard[slots], chunk.lo[slots] // s
    if key.size:
        got = np.empty((key.size, s), streams[int(key[0])].dtype)
        edges = [0, *(np.flatnonzero(key[1:] != key[:-1]) + 1).tolist(), key.size]
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            stream = streams[int(key[a])]
            whole = stream[: stream.size // s * s].reshape(-1, s)
            np.take(whole, at[a:b], axis=0, out=got[a:b], mode="clip")  # clip: not buffered
        flat_rows[slots] = got
    return _copy_each(chunk, streams, flat_rows, np.flatnonzero(~full).tolist(), fill)


_GATHER_ROWS = 256  # rows from which copy_rows gathers by shard rather than row by row


def _copy_each(
    chunk: ChunkLayout,
    streams: dict[int, np.ndarray],
    flat_rows: np.ndarray,
    slots: Iterable[int],
    fill: int,
) -> list[tuple[int, int]]:
    """:func:`copy_rows` one row at a time, for ``slots``."""
    s = flat_rows.shape[1]
    padded = []
    shards, los, ns = chunk.shard.tolist(), chunk.lo.tolist(), chunk.n.tolist()
    for slot in slots:
        shard, lo, n = shards[slot], los[slot], ns[slot]
        if n == s:
            flat_rows[slot] = streams[shard][lo : lo + n]
            continue
        if n:
            flat_rows[slot, :n] = streams[shard][lo : lo + n]
        flat_rows[slot, n:] = fill
        padded.append((slot, n))
    return padded


def build(
    planner: TokenBlocks,
    chunk: ChunkLayout,
    tokens: dict[int, np.ndarray],
    worker: int | None,
    ring: Any,
    repeated: np.ndarray,
    lean: np.dtype | None,
) -> list[Any]:
    """Assemble a chunk's batches into one buffer: in a worker the one item that crosses (a
    buffer, or a ring slot: NOTE [bundles] in :mod:`shardloader.deliver.transport`), in this
    process its batches.  ``repeated``: per batch, whether it repeats one for equal steps
    (NOTE [flagged repeats]); ``lean``: the shards' id dtype for lean batches (NOTE [lean
    batches] in :mod:`shardloader.batching.lean`)."""
    shape = (chunk.k, chunk.rows_per_batch, chunk.seq_len, chunk.cu.size)
    pad, labels = planner.pad_id or 0, planner.repeat_labels
    if lean is not None:
        out = TokenBatches(*shape, worker, ring, (lean.name, pad, labels))
        copy_rows(chunk, tokens, out.ids)
        np.copyto(out.row_tokens, chunk.n.reshape(out.row_tokens.shape), casting="unsafe")
        flag_rows(out.pad, None, chunk.shard, repeated, labels)
    else:
        out = TokenBatches(*shape, worker, ring)
        assemble(chunk, tokens, out.block, pad)
        flag_rows(out.pad, out.block[1], chunk.shard, repeated, labels)
    out.cu[:] = chunk.cu
    out.cu_sizes = tuple((np.diff(chunk.cuts) + 1).tolist())
    out.max_seqlen = tuple(chunk.max_seqlen.tolist())
    if worker is not None:
        out.bundle = chunk.k > 1
        return [out]
    return out.batches()


def flag_rows(
    pad: np.ndarray,
    labels: np.ndarray | None,
    shard: np.ndarray,
    repeated: np.ndarray,
    mode: str,
) -> None:
    """Fill the ``[k, R]`` row flags of ``k`` assembled batches (``shard`` of each row, -1 for
    padding rows; ``repeated`` per batch) and, under ``mode="ignore"``, set a repeated batch's
    ``[k, R, S]`` labels to -100 (NOTE [flagged repeats]; a lean batch has no labels: the
    device makes them from the flags)."""
    k, rows = pad.shape
    np.less(shard.reshape(k, rows), 0, out=pad)
    if repeated.any():
        pad[repeated] = True
        if mode == "ignore" and labels is not None:
            labels[repeated] = IGNORE_INDEX
