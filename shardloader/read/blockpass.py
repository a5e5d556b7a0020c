"""One pass of a :class:`~shardloader.batching.blocks.TokenBlocks` dataset in one process.

The dataset plans the epoch as usual (global batches of row ids, dealt to ranks and workers by
:mod:`shardloader.plan.split`) and hands this module the pass.  Batches are assembled a chunk (a
bundle, in a worker) at a time: each row is one slice of a staged token shard's memory map,
and the other fields follow from the sidecars' lengths with numpy over the whole chunk
(:func:`~shardloader.batching.blocks.assemble`).  No sample is read, decoded or collated, and
no sidecar key is parsed: the block path needs the ``length`` column only
(:func:`shardloader.read.lengths.load_lengths`).

In a DataLoader worker the chunk is written straight into one shared-memory buffer and crosses
to the main process as that buffer (:mod:`shardloader.deliver.transport`, NOTE [bundles] there).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.batching.blockchunks import assemble, chunk_layout, copy_rows
from shardloader.batching.rowflags import flag_rows, repeated_steps
from shardloader.deliver.transport import TokenBatches
from shardloader.errors import ShardChangedError
from shardloader.format.tokens.format import TokenStream
from shardloader.format.tokens.layout import stream_field, token_dtype
from shardloader.read.shardset import ShardSet

if TYPE_CHECKING:
    from shardloader.batching.blockchunks import ChunkLayout
    from shardloader.batching.blocks import RowLayout, TokenBlocks
    from shardloader.manifest import Manifest
    from shardloader.plan.epoch import EpochPlan
    from shardloader.plan.shuffle import ShuffleOptions
    from shardloader.plan.split import Place
    from shardloader.read.shardset import ReadOptions

__all__ = ["BlockSource", "iterate_blocks", "steps_of_worker"]

_CHUNK = 8  # batches assembled into one buffer in a process without workers (measured: 2, 4,
#            8, 16 batches; 8 was fastest; lean batches: 8 and 64 measured alike)
_SPAN = 64  # batches whose rows and segments are worked out together
_STREAMS = 128  # open token shards per pass


@dataclass(frozen=True)
class BlockSource:
    """What a pass reads, handed over by the dataset (it keeps its state to itself)."""

    planner: TokenBlocks
    manifest: Manifest
    base: str
    read: ReadOptions
    shuffle: ShuffleOptions
    lengths: np.ndarray  # every document's token count, by global id
    bundle: int = 1  # batches per worker output (NOTE [bundles] in deliver/transport.py)
    ring: Any = None  # the loader's shared buffers (NOTE [ring slots] there)
    # (where, working set) -> what the pass reads shards through: a mixture's MixedShards
    shard_set: Any = None


def steps_of_worker(steps: int, worker: int, workers: int, bundle: int) -> np.ndarray:
    """The rank's step numbers this worker serves: bundle ``c`` (steps ``c*bundle`` ..) goes
    to worker ``c mod workers`` (NOTE [bundles] in :mod:`shardloader.deliver.transport`)."""
    j = np.arange(steps, dtype=np.int64)
    return j[(j // bundle) % workers == worker]


def iterate_blocks(ds: BlockSource, plan: EpochPlan, place: Place) -> Iterator[Any]:
    """Yield this worker's batches of the planned pass (all of the rank's without workers).

    (Assembling the next chunk in a thread while the loop runs was measured and dropped: the
    Python between numpy calls holds the GIL, so nothing overlapped and the hand-over cost
    15 % more time per batch.)
    """
    for chunk in _chunks(ds, plan, place):
        yield from chunk


def _chunks(ds: BlockSource, plan: EpochPlan, place: Place) -> Generator[Any, None, None]:
    """This worker's chunks: in a worker one item to yield each (a bundle), in this process
    the list of the chunk's batches."""
    from torch.utils.data import get_worker_info

    planner: TokenBlocks = ds.planner
    layout = planner.layout(ds.manifest.shard_sizes, ds.lengths)
    info = get_worker_info()
    worker = None if info is None else int(info.id)
    ring = ds.ring
    bundle = max(ds.bundle, 1) if worker is not None else _CHUNK
    mine = steps_of_worker(len(plan.slots.slots), place.worker, place.num_workers, bundle)
    slots = plan.slots.slots[mine]
    repeated = repeated_steps(plan, mine)  # NOTE [flagged repeats] in batching/rowflags.py
    labels = planner.repeat_labels
    need = _working_set(ds, layout, plan)
    if ds.shard_set is not None:  # NOTE [token rows mix] in plan/rowmix.py
        shards = ds.shard_set(str(place), need)
    else:
        shards = ShardSet(ds.manifest, ds.base, ds.read, str(place), need)
    streams = _Streams(shards, ds.lengths, ds.manifest.shard_sizes)
    upcoming = _first_needed(layout, plan, slots)
    ahead = 0
    pad = planner.pad_id if planner.pad_id is not None else 0
    lean = None
    if planner.lean:  # the shards' own id dtype, from the manifest
        fields = ds.manifest.fields
        lean = token_dtype(fields.get(stream_field(fields) or ""))
    try:
        cuts = np.flatnonzero(np.diff(mine // bundle, prepend=-1)).tolist() + [mine.size]
        groups = list(zip(cuts[:-1], cuts[1:]))  # noqa: B905 - one shorter by construction
        per_span = max(1, _SPAN // bundle)
        g = 0
        while g < len(groups):
            span = groups[g : g + (per_span if g else 1)]  # the first batch comes first
            g += len(span)
            ahead = _readahead(shards, upcoming, span[-1][1] - 1, ahead)
            first = span[0][0]
            batches = [plan.batches[int(s)] for s in slots[first : span[-1][1]]]
            whole = chunk_layout(layout, batches, planner.rows_per_batch)
            streams.check(whole)
            for a, b in span:
                part = whole.part(a - first, b - first)
                yield _emit(part, streams, pad, worker, ring, (repeated[a:b], labels), lean)
    finally:
        streams.close()
        shards.close()


def _emit(
    chunk: ChunkLayout,
    streams: _Streams,
    pad: int,
    worker: int | None,
    ring: Any,
    repeats: tuple[np.ndarray, str],
    lean: np.dtype | None = None,
) -> list[Any]:
    """Assemble one chunk into one buffer: in a worker the one item that crosses (a buffer, or
    a ring slot), in this process its batches."""
    shape = (chunk.k, chunk.rows_per_batch, chunk.seq_len, chunk.cu.size)
    if lean is not None:  # NOTE [lean batches] in batching/lean.py
        out = TokenBatches(*shape, worker, ring, (lean.name, pad, repeats[1]))
        copy_rows(chunk, streams.tokens, out.ids)
        np.copyto(out.row_tokens, chunk.n.reshape(out.row_tokens.shape), casting="unsafe")
        flag_rows(out.pad, None, chunk.shard, *repeats)
    else:
        out = TokenBatches(*shape, worker, ring)
        assemble(chunk, streams.tokens, out.block, pad)
        flag_rows(out.pad, out.block[1], chunk.shard, *repeats)
    out.cu[:] = chunk.cu
    out.cu_sizes = tuple((np.diff(chunk.cuts) + 1).tolist())
    out.max_seqlen = tuple(chunk.max_seqlen.tolist())
    if worker is not None:
        out.bundle = chunk.k > 1
        return [out]
    return out.batches()


class _Streams:
    """The token arrays of the shards a pass reads (staged through the shard set), checked
    chunk by chunk on first touch."""

    def __init__(
        self, shards: ShardSet, lengths: np.ndarray | None, shard_sizes: np.ndarray
    ) -> None:
        self.shards = shards
        self.open: dict[int, TokenStream] = {}
        self.tokens: dict[int, np.ndarray] = {}
        self.checked: set[int] = set()  # open shards whose every token chunk is checked
        assert lengths is not None  # TokenBlocks.bind loaded them
        self._lengths = lengths
        self._starts = np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64)

    def _open(self, shard: int, needed: set[int]) -> None:
        """Open ``shard``; past :data:`_STREAMS` open ones, close the least recently used that
        the current span does not need."""
        for old in [s for s in self.open if s not in needed][
            : max(len(self.open) - _STREAMS + 1, 0)
        ]:
            self.open.pop(old).close()
            del self.tokens[old]
            self.checked.discard(old)
        path = self.shards.files.local_file(shard)
        stream = TokenStream(path, self.shards.describe(shard), self.shards.options.verify_samples)
        try:
            a, b = int(self._starts[shard]), int(self._starts[shard + 1])
            stream.expect(b - a, int(self._lengths[a:b].sum()))
        except BaseException:
            stream.close()
            raise
        self.open[shard], self.tokens[shard] = stream, stream.tokens

    def check(self, chunk: ChunkLayout) -> None:
        """Open the shards of a span's rows (all of them stay open while it is assembled) and
        check the token chunks its rows touch."""
        shards = set(chunk.shard.tolist())
        shards.discard(-1)
        for shard in shards & self.open.keys():  # most recently used last
            self.open[shard] = self.open.pop(shard)
            if (change := self.open[shard].file.changed()) is not None:  # NOTE [no SIGBUS]
                self.open.pop(shard).close()
                del self.tokens[shard]
                self.checked.discard(shard)
                if not self.shards.restage(shard):  # a staged copy: opened again below
                    raise ShardChangedError(f"{self.shards.describe(shard)}: {change}")
        if shards <= self.checked:
            return
        for shard in shards - self.checked:
            stream = self.open.get(shard)
            if stream is None:
                self._open(shard, shards)
                stream = self.open[shard]
            mine = chunk.shard == shard
            lo = chunk.lo[mine]
            stream.check_tokens(lo, lo + chunk.n[mine])
            if stream.all_checked:
                self.checked.add(shard)

    def close(self) -> None:
        for stream in self.open.values():
            stream.close()
        self.open.clear()
        self.tokens.clear()


def _working_set(ds: BlockSource, layout: RowLayout, plan: EpochPlan) -> int:
    """Staged bytes the plan keeps in use at once (the shards under one shuffle block of rows,
    or two neighbouring shards unshuffled), plus the read-ahead."""
    manifest = ds.manifest
    raw = np.fromiter((s.raw_bytes for s in manifest.shards), np.int64, len(manifest.shards))
    order = np.asarray(plan.order)  # rows of token streams: planned whole (plan/epoch.py)
    if raw.size == 0 or order.size == 0:
        return 0
    ahead = ds.read.readahead * int(raw.max())
    if not ds.shuffle.enabled:
        return int(np.sort(raw)[-2:].sum()) + ahead
    shard_of = np.searchsorted(layout.row_bounds, order, side="right") - 1
    peak = 0
    for lo in range(0, order.size, ds.shuffle.block):
        peak = max(peak, int(raw[np.unique(shard_of[lo : lo + ds.shuffle.block])].sum()))
    return peak + ahead


def _first_needed(layout: RowLayout, plan: EpochPlan, slots: np.ndarray) -> np.ndarray:
    """``[n, 2]`` (step, shard) for each shard in the order this worker first needs it."""
    if not slots.size:
        return np.zeros((0, 2), np.int64)
    batches = [plan.batches[int(s)] for s in slots]
    rows = np.concatenate(batches)
    step = np.repeat(np.arange(slots.size), [b.size for b in batches])
    shard_of = np.searchsorted(layout.row_bounds, rows, side="right") - 1
    _, first = np.unique(shard_of, return_index=True)
    first.sort()
    return np.stack([step[first], shard_of[first]], axis=1)


def _readahead(shards: ShardSet, upcoming: np.ndarray, step: int, ahead: int) -> int:
    """Stage in the background the shards needed up to ``step`` and ``readahead`` more; return
    how many of ``upcoming`` are submitted."""
    limit = shards.options.readahead
    if shards.in_place or limit <= 0:
        return ahead
    due = int(np.searchsorted(upcoming[:, 0], step, side="right"))
    target = min(len(upcoming), due + limit)
    if target > ahead:
        shards.prefetch(int(s) for s in upcoming[ahead:target, 1])
        return target
    return ahead
