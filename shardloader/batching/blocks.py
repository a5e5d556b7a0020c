"""Token blocks: batches of rows cut straight out of each shard's token stream.

NOTE [what a row is]
    Every shard of a token dataset (``pack --format tokens --tokenizer``) holds its documents'
    tokens end to end.  Row ``j`` of shard ``s`` is the window ``[j * seq_len, (j + 1) *
    seq_len)`` of that stream; the shard's last ``tokens % seq_len`` tokens are a row of their
    own padded to ``seq_len`` (``remainder="pad"``) or are left out (``"drop"``).  A row never
    straddles shards.  Rows are numbered across the dataset, shards in manifest order (global
    row ids), so every process derives the same rows from the manifest and the sidecars'
    ``length`` columns alone.  An epoch orders the rows as :func:`shardloader.plan.shuffle.
    epoch_order` orders samples (shards permuted, then rows permuted inside blocks of
    ``ShuffleOptions.block`` rows), and cuts that order into batches of ``rows_per_batch``
    rows: a batch is a ``[k]`` array of row ids, ``k < rows_per_batch`` only for the epoch's
    last batch (``tail="keep"``: its missing rows are padding).  The dataset deals these
    batches to ranks and workers like any other (DESIGN.md "Order and split"), so padding,
    dropping, resume and worker-count independence hold unchanged; every token of the epoch
    is in exactly one row of exactly one batch.

Documents inside a row are told apart by the sidecars' token counts: ``position_ids`` restart
and ``labels`` are -100 at every document start inside a row and at the row's first token (a
document cut by a row boundary continues, from position 0, in another row), ``cu_seqlens``
lists the segments in flash-attn's varlen format.  All of it is computed with numpy over whole
batches (:func:`shardloader.batching.blockchunks.assemble`), never per document in Python.

Planning costs numpy work over the rows and the documents' lengths, nothing per document in
Python.  The pass (:mod:`shardloader.read.samplepass`) loads rows through the token format
(:mod:`shardloader.format.tokens.rows`) and assembles them
(:mod:`shardloader.batching.blockchunks`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from shardloader.batching.base import (
    TAIL_POLICIES,
    BatchPlanner,
    check_choice,
    check_pad_id,
    check_positive,
)
from shardloader.errors import UsageError

__all__ = ["FIELDS", "REMAINDER_POLICIES", "RowLayout", "TokenBlocks"]

REMAINDER_POLICIES = ("pad", "drop")
# (id(lengths), seq_len, remainder) -> (weak ref to lengths, shard sizes, layout)
_LAYOUTS: dict[tuple[int, int, str], tuple[Any, np.ndarray, RowLayout]] = {}
FIELDS = ("input_ids", "labels", "position_ids", "attention_mask")


@dataclass(frozen=True)
class RowLayout:
    """Where the rows of a dataset lie: per shard its token count, the global token offset
    of its stream and its first global row id (each array has one more entry at the end)."""

    seq_len: int
    shard_tokens: np.ndarray  # int64 [shards]
    token_bases: np.ndarray  # int64 [shards + 1]: global token offset of each shard's stream
    row_bounds: np.ndarray  # int64 [shards + 1]: first global row id of each shard
    bounds: np.ndarray  # int64: global token offsets where a non-empty document starts
    inside: np.ndarray  # int64 [rows + 1]: row r's inner document starts are bounds[inside[r]:
    #                     inside_end[r]] (strictly inside the row)
    inside_end: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.row_bounds[-1])

    @property
    def rows_per_shard(self) -> np.ndarray:
        return np.diff(self.row_bounds)

    def windows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, start inside the shard's stream, token count) of each global row id."""
        shard = np.searchsorted(self.row_bounds, rows, side="right") - 1
        lo = (rows - self.row_bounds[shard]) * self.seq_len
        n = np.minimum(self.seq_len, self.shard_tokens[shard] - lo)
        return shard, lo, n

    def covered(self, lengths: np.ndarray, shard_sizes: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Tokens of each document (``lengths``, ``shard_sizes`` documents a shard) inside the
        rows ``rows`` (global row ids): numpy over documents, a shard at a time."""
        s = self.seq_len
        lens = np.asarray(lengths, np.int64)
        delivered = np.zeros(self.num_rows, bool)
        delivered[np.asarray(rows, np.int64)] = True
        got = np.zeros(lens.size, np.int64)
        doc = 0
        for shard, count in enumerate(np.asarray(shard_sizes, np.int64).tolist()):
            mine = delivered[self.row_bounds[shard] : self.row_bounds[shard + 1]]
            flags = np.append(mine, False)  # one more: past the end
            full_before = np.concatenate([[0], np.cumsum(flags)])  # delivered rows before row j
            start = np.concatenate([[0], np.cumsum(lens[doc : doc + count])])

            # delivered tokens of [0, x) of the shard's stream, for each document start x
            j = np.minimum(start // s, flags.size - 1)
            covered = s * full_before[j] + (start - j * s) * flags[j]
            got[doc : doc + count] = np.diff(covered)
            doc += count
        return got


@dataclass(frozen=True)
class TokenBlocks(BatchPlanner):
    """Batches of ``rows_per_batch`` rows of ``seq_len`` tokens, each row one window of a
    shard's token stream (NOTE [what a row is]); needs a ``tokens``-format dataset.

    ``remainder``: a shard's last ``tokens % seq_len`` tokens are a padded row (``"pad"``,
    default: every token of the epoch is delivered) or are left out (``"drop"``; reported).
    ``tail``: the epoch's last batch, when fewer than ``rows_per_batch`` rows are left, is
    filled up with padding rows (``"keep"``, default) or left out (``"drop"``; reported).
    ``pad_id`` (the tokenizer's pad id, e.g. its vocabulary size) fills padding; it is needed
    unless both are ``"drop"``.

    Each batch is a dict: ``input_ids``, ``labels`` (the ids unshifted, -100 at each segment's
    first token and on padding), ``position_ids`` (restarting at every segment), and
    ``attention_mask`` (1 real, 0 padding), all int64 ``[rows_per_batch, seq_len]``;
    ``cu_seqlens`` int32 (segment bounds in the flattened batch, each row's padding a segment
    of its own, ending at ``rows_per_batch * seq_len``) and ``max_seqlen``, as
    :class:`~shardloader.batching.PackCollate` gives them; ``__pad__`` (bool ``[rows_per_batch]``)
    flags padding rows and rows repeated for equal steps under ``uneven="pad"``, whose labels
    are -100 unless ``repeat_labels="keep"`` (NOTE [flagged repeats] in
    :mod:`shardloader.batching.blockchunks`).  A document that a row boundary cuts
    continues in another row, its pieces each starting at position 0.

    ``lean=True`` hands over ``input_ids`` in the shards' own dtype (uint16 or uint32) with
    ``row_tokens``, ``cu_seqlens`` and ``__pad__`` instead of the four int64 fields;
    :func:`shardloader.batching.expand_on_device` makes those on the GPU, equal to the
    default batch's (NOTE [lean batches] in :mod:`shardloader.batching.lean`).
    """

    seq_len: int
    rows_per_batch: int
    pad_id: int | None = None
    remainder: str = "pad"
    tail: str = "keep"
    # -100 on rows repeated for equal steps, or "keep" (NOTE [flagged repeats] in
    # batching/blockchunks.py); not in the plan signature: it changes no row of the plan
    repeat_labels: str = field(default="ignore", repr=False)
    # batches of the shard's own ids and what a device needs to make the rest (NOTE [lean
    # batches] in batching/lean.py); not in the plan signature: the same tokens go where
    lean: bool = field(default=False, repr=False)
    needs_lengths = True
    elastic = "rows_per_batch"  # what a resume may change (shardloader/plan/elastic.py)
    units = "rows"  # the pass loads rows of token shards (read/samplepass.py)

    def __post_init__(self) -> None:
        check_positive("seq_len", self.seq_len)
        check_positive("rows_per_batch", self.rows_per_batch)
        check_choice("remainder", self.remainder, REMAINDER_POLICIES)
        check_choice("tail", self.tail, TAIL_POLICIES)
        check_choice("repeat_labels", self.repeat_labels, ("ignore", "keep"))
        if not isinstance(self.lean, bool):
            raise UsageError(f"TokenBlocks(lean=) is True or False, got {self.lean!r}")
        check_pad_id(self.pad_id)
        if self.pad_id is None and (self.remainder, self.tail) != ("drop", "drop"):
            raise UsageError(
                "TokenBlocks pads a shard's last partial row (remainder='pad') and the epoch's "
                "last partial batch (tail='keep'): pass pad_id= (e.g. the tokenizer's "
                "vocabulary size), or remainder='drop' and tail='drop'"
            )

    @property
    def batch_bytes(self) -> int:
        """Bytes of one batch's four int64 ``[rows, seq_len]`` fields, or a lean batch's ids
        (at most 4 bytes a token): the transport sizes its bundles by it."""
        return (4 if self.lean else 4 * 8) * self.rows_per_batch * self.seq_len

    # -- the dataset's questions ----------------------------------------------------------
    def bind(self, dataset: Any) -> None:
        """Refuse what cannot apply to rows of a token stream (called by ShardedDataset when it
        is made; it then loads the documents' token counts, the manifest's lengths)."""
        from shardloader.format.tokens.format import stream_field

        m = dataset.manifest
        if m.format != "tokens":
            raise UsageError(
                f"TokenBlocks reads rows straight out of token shards, but {dataset.url} holds "
                f"{m.format} shards: re-pack it with `shardloader pack SRC OUT --format tokens` "
                "and --tokenizer tokenizer.json (text) or --token-field input_ids (records that "
                "hold token ids)"
                + (
                    f"; or use PackedBatches, which packs these shards' {m.length_field!r} token "
                    "ids into rows as they are"
                    if m.length_field in m.fields and m.fields[m.length_field].codec == "tokens"
                    else ""
                )
            )
        field = stream_field(m.fields)
        if field is None or m.length_field != field:
            raise UsageError(
                f"{dataset.url}: TokenBlocks needs the manifest's length field to be the token "
                f"field the shards stream ({field!r}), it is {m.length_field!r}: re-pack with "
                "--format tokens and --tokenizer or --token-field, which record both"
            )
        for name, value, why in (
            ("transform", dataset.transform, "it works on samples, and rows are no samples"),
            ("collate_fn", dataset.collate_fn, "TokenBlocks builds its batches itself"),
        ):
            if value is not None:
                raise UsageError(f"TokenBlocks takes no {name}= ({why})")
        if dataset.on_error != "raise":
            raise UsageError(
                "TokenBlocks reads whole windows of a shard's token stream, so a damaged shard "
                "cannot be skipped sample by sample: use on_error='raise'"
            )

    # -- planning (pure) ------------------------------------------------------------------
    def layout(self, shard_sizes: np.ndarray, lengths: np.ndarray | None) -> RowLayout:
        """The rows of a dataset of these shard sizes and per-document token counts (worked
        out once per process and lengths array: every epoch, ``len()`` and report reuse it)."""
        key = (id(lengths), self.seq_len, self.remainder)
        cached = _LAYOUTS.get(key)
        sizes = np.asarray(shard_sizes, np.int64)
        if cached is not None and cached[0]() is lengths and np.array_equal(cached[1], sizes):
            return cached[2]
        if lengths is None:
            raise UsageError("TokenBlocks needs the sidecars' token counts (a length field)")
        lens = np.asarray(lengths, np.int64)
        if lens.size != int(sizes.sum()):
            raise UsageError(f"{lens.size} lengths for {int(sizes.sum())} documents")
        cum = np.concatenate([[0], np.cumsum(lens)])
        doc_bounds = np.concatenate([[0], np.cumsum(sizes)])
        token_bases = cum[doc_bounds]
        shard_tokens = np.diff(token_bases)
        rows = shard_tokens // self.seq_len
        if self.remainder == "pad":
            rows += shard_tokens % self.seq_len > 0
        row_bounds = np.concatenate([[0], np.cumsum(rows)])
        bounds = cum[:-1][lens > 0]
        lay = RowLayout(self.seq_len, shard_tokens, token_bases, row_bounds, bounds, bounds, bounds)
        shard, lo, n = lay.windows(np.arange(lay.num_rows, dtype=np.int64))
        g = token_bases[shard] + lo
        inside = np.searchsorted(bounds, g, side="right")
        inside_end = np.searchsorted(bounds, g + n, side="left")
        lay = replace(lay, inside=inside, inside_end=inside_end)
        if len(_LAYOUTS) >= 8:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[key] = (weakref.ref(lengths), sizes, lay)
        return lay

    def plan(
        self, order: np.ndarray, lengths: np.ndarray | None, rng: np.random.Generator
    ) -> list[np.ndarray]:
        """Batches of ``rows_per_batch`` of the row ids ``order`` (``units == "rows"``) in
        order, the last one short (``tail="keep"``) or left out: the epoch's rows, or after an
        elastic resume the rows an earlier batch shape did not deliver."""
        rows = np.asarray(order, np.int64)
        r = self.rows_per_batch
        full = rows.size // r
        batches = list(rows[: full * r].reshape(full, r))
        if rows.size > full * r and self.tail == "keep":
            batches.append(rows[full * r :])
        return batches

    def count_rows(self, rows: int) -> int:
        """How many batches :meth:`plan` cuts ``rows`` rows into (by arithmetic)."""
        r = self.rows_per_batch
        return rows // r + (self.tail == "keep" and rows % r > 0)

    def units_per_shard(self, shard_sizes: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
        """Each shard's rows: what the epoch orders."""
        return self.layout(shard_sizes, lengths).rows_per_shard

    def row_slots(self, other: BatchPlanner) -> int:
        """Token slots a batch of ``other`` (this planner with another ``rows_per_batch``, an
        earlier link of an elastic resume) allocates more than one of this planner's."""
        assert isinstance(other, TokenBlocks)
        return self.seq_len * (other.rows_per_batch - self.rows_per_batch)

    def report_stream(
        self,
        shard_sizes: np.ndarray,
        lengths: np.ndarray | None,
        batches: list[np.ndarray],
        repeats: list[np.ndarray],
        scope: np.ndarray | None = None,
    ) -> dict[str, int]:
        """Where every token goes when ``batches`` (each once) and ``repeats`` (batches
        delivered again) are delivered: documents dropped or truncated (by the remainder, the
        tail or ``uneven="drop"``), tokens delivered, truncated, dropped, repeated, and the
        token slots allocated.  The EpochReport fields, by name.  ``scope``: the epoch's rows
        when it holds only some (a mixture epoch, NOTE [token rows mix] in plan/rowmix.py):
        a document's tokens outside them are another epoch's, not dropped ones."""
        lay = self.layout(shard_sizes, lengths)
        lens = np.asarray(lengths, np.int64)
        rows = np.concatenate(batches) if batches else np.zeros(0, np.int64)
        _, _, n = lay.windows(np.arange(lay.num_rows))
        got = lay.covered(lens, shard_sizes, rows)
        if scope is not None:
            lens = lay.covered(lens, shard_sizes, scope)
        dropped = (got == 0) & (lens > 0)
        truncated = (got > 0) & (got < lens)
        again = np.concatenate(repeats) if repeats else np.zeros(0, np.int64)
        return {
            "dropped_samples": int(dropped.sum()),
            "truncated_samples": int(truncated.sum()),
            "tokens": int(n[rows].sum()),  # a mixture's row in two source epochs: twice
            "truncated_tokens": int((lens - got)[truncated].sum()),
            "dropped_tokens": int(lens[dropped].sum()),
            "repeated_tokens": int(n[again].sum()),
            "token_slots": (len(batches) + len(repeats)) * self.rows_per_batch * self.seq_len,
            "padded_samples": int(again.size),
        }
