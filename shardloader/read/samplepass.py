"""One pass in one process: the worker's steps read ahead, loaded and collated.

The dataset plans the epoch (:mod:`shardloader.plan.epoch`) and hands this module the pass.  A
plan batches *units*: samples, or for a :class:`~shardloader.batching.blocks.TokenBlocks`
planner rows of token shards (NOTE [what a row is] there), which the token format cuts as a
tar shard holds samples.  One pass serves both: this worker's steps
(:class:`~shardloader.plan.steps.WorkerSteps`, worked out as walked), the node's read-ahead
staging shards ahead (:func:`~shardloader.read.readahead.pass_readahead`), then the load stage
of the unit:

* samples: the batch is read with up to 15 more whose shards are open already
  (:func:`_read_ahead`), loaded by :class:`~shardloader.read.loading.SampleLoader` (decode,
  seeded transform) and collated;
* rows: a span of batches is sliced out of the staged shards' memory maps
  (:class:`~shardloader.format.tokens.rows.TokenRows`, checked chunk by chunk) and assembled a
  chunk (a bundle, in a worker) at a time by TokenBlocks' collate
  (:func:`~shardloader.batching.blockchunks.build`): no sample is read, decoded or collated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.batching.base import batch_ids
from shardloader.batching.blockchunks import build, chunk_layout
from shardloader.batching.raw import RawCollate
from shardloader.format.base import Rows
from shardloader.format.tokens.layout import stream_field, token_dtype
from shardloader.format.tokens.rows import TokenRows
from shardloader.plan.partition import Partition
from shardloader.plan.shuffle import derive_seeds, transform_seeds
from shardloader.plan.steps import StepSeeds, WorkerSteps, is_lazy, pass_working_set
from shardloader.read.loading import SampleLoader, pipeline_draws
from shardloader.read.readahead import pass_readahead
from shardloader.read.seeding import generator_of, seed_global_rngs
from shardloader.read.shardset import working_set_bytes

if TYPE_CHECKING:
    from shardloader.batching.blocks import TokenBlocks
    from shardloader.codecs.allowlist import Decoder
    from shardloader.manifest import Manifest
    from shardloader.plan.epoch import EpochPlan
    from shardloader.plan.shuffle import ShuffleOptions
    from shardloader.plan.split import Place
    from shardloader.read.fields import FieldMap
    from shardloader.read.readahead import ReadAhead
    from shardloader.read.shardset import ReadOptions, ShardSet
    from shardloader.read.skips import SkipLog

__all__ = ["SampleSource", "iterate_samples"]

# batches a worker reads in one pass over their shards (see _read_ahead): at most this many,
# holding at most about this many bytes of samples.  Each shard a pass touches costs a dozen
# numpy calls, so the pass must take many samples from each: a shuffled batch of 32 photos
# of 30 KB spans ~9 shards, and at 1 MiB (one batch a pass) reading cost 22 us a sample, at
# 8 MiB (8 batches) 14 us
_READ_AHEAD, _READ_AHEAD_BYTES = 16, 8 << 20
_CHUNK = 8  # default row batches assembled into one buffer in a process without workers
#            (measured: 2, 4, 8, 16 batches; 8 was fastest); lean batches take larger chunks
#            (NOTE [lean chunks] below: 8, 64, 128, 256 batches cost 37.5, 28.3, 25.5, 23.0 us)
_SPAN = 64  # row batches whose rows and segments are worked out together


@dataclass(frozen=True)
class SampleSource:
    """What a pass reads and how, handed over by the dataset (it keeps its state to itself)."""

    manifest: Manifest
    read: ReadOptions
    shuffle: ShuffleOptions
    uneven: str
    seed: int
    batched: bool  # batch_size or a planner: steps are batches, else single samples
    open_shards: Callable[[str, int], Any]  # (where, working set) -> ShardSet or MixedShards
    field_map: FieldMap
    decoder: Decoder | None
    transform: Callable[..., Any] | None
    collate_fn: Callable[[list[dict[str, Any]]], Any] | None
    on_error: str
    lengths: np.ndarray | None  # by global id, for cutting segment batches
    skip_log: SkipLog | None  # where run-time skips are appended (read/skips.py)
    partition: Partition = Partition()  # how the world is cut (shardloader.plan.partition)
    rows: TokenBlocks | None = None  # the planner, when its units are token rows
    bundle: int = 1  # row batches per worker output (NOTE [bundles] in deliver/transport.py)
    ring: Any = None  # the loader's shared buffers (NOTE [ring slots] there)


def iterate_samples(ds: SampleSource, plan: EpochPlan, place: Place, epoch: int) -> Iterator[Any]:
    """Yield this worker's batches (or samples, unbatched; or bundles of row batches) of the
    planned pass of ``epoch``."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    worker = None if info is None else int(info.id)
    # bundles: of row batches, or of raw batches (NOTE [raw bundles] in batching/raw.py)
    bundle = max(ds.bundle, 1) if worker is not None else 1
    steps = WorkerSteps(plan, place.worker, place.num_workers, bundle)  # worked out as walked
    bounds = None
    if ds.rows is not None:  # a row's shard: by the rows' bounds (batching/blocks.py)
        bounds = ds.rows.layout(ds.manifest.shard_sizes, ds.lengths).row_bounds
    shard_of = None if bounds is None else functools.partial(_shard_of, bounds)
    shards = ds.open_shards(str(place), _working_set(ds, plan, bounds))
    try:
        readahead = pass_readahead(shards, plan, place, ds.read.readahead, ds.partition, shard_of)
        if ds.rows is None:
            loaded = _load_samples(ds, plan, place, epoch, steps, shards, readahead)
            yield from loaded if bundle == 1 else _bundled(loaded, bundle)
        else:
            per = bundle if worker is not None else _CHUNK
            yield from _load_rows(ds, ds.rows, plan, steps, shards, readahead, worker, per)
    finally:
        shards.close()


def _load_samples(
    ds: SampleSource,
    plan: EpochPlan,
    place: Place,
    epoch: int,
    steps: WorkerSteps,
    shards: Any,
    readahead: ReadAhead,
) -> Iterator[Any]:
    """The load stage of samples: read, decode, transform (seeded per step), collate."""
    loader = SampleLoader(
        ds.field_map,
        ds.decoder,
        ds.transform,
        ds.on_error,
        ds.manifest.length_field,
        ds.lengths,
        None if ds.skip_log is None else functools.partial(_skipped, ds.skip_log, epoch),
    )
    batched = ds.batched
    # NOTE [what the global seeds are for]: torch/numpy/random are seeded per batch only
    # for code that may draw from them (a transform, custom decoders, a collate that is
    # not shardloader's: pipeline_draws); shardloader's own parts never do, so a pipeline
    # of those alone skips the ~20 us a batch costs.  Seeds are derived for a window of
    # steps at once (derive_seeds gives exactly derive_seed's values).
    global_seeds = None
    offset = plan.seed_offset  # after a batch-shape change: fresh numbers
    if pipeline_draws(ds.transform, ds.decoder, ds.collate_fn):
        global_seeds = StepSeeds(steps, lambda q: derive_seeds(ds.seed, epoch, q + offset))
    generator_seeds = None
    if loader.takes_generator:
        generator_seeds = StepSeeds(steps, lambda q: transform_seeds(ds.seed, epoch, q + offset))
    raw = (
        isinstance(ds.collate_fn, RawCollate)
        and ds.decoder is None
        and ds.transform is None
        and batched
    )
    read: dict[int, Rows] = {}  # batches read ahead (see _read_ahead)
    most = _read_ahead_batches(ds.manifest, steps)
    for j, slot, seed_index in steps.walk():
        readahead.advance(j * place.num_workers + place.worker)  # this rank's step
        rows = read.pop(j, None)
        if rows is None:
            rows = _read_ahead(shards, steps, j, read, most)
        batch, ids = steps.batch(j), steps[j]
        if global_seeds is not None:
            seed_global_rngs(global_seeds[j])
        pads = plan.pad_mask(slot, seed_index, len(ids))
        if raw and batch.ndim == 1:
            yield loader.load_raw(shards, ids, pads, place, rows)
            continue
        generator = None
        if generator_seeds is not None:
            generator = generator_of(generator_seeds[j])
        samples, substituted = loader.load_batch(shards, ids, pads, place, generator, rows)
        if batch.ndim == 2:
            samples = loader.cut_segments(batch, ids, samples, substituted, place)
        if not batched:
            if samples:
                yield samples[0]
        else:
            yield _collate(ds.collate_fn, samples, shards)


def _bundled(batches: Iterator[Any], k: int) -> Iterator[Any]:
    """``batches`` as bundles of ``k`` (the last may hold fewer): a worker's steps come in
    whole bundles of consecutive rank steps (WorkerSteps), so its ``k`` consecutive batches
    are one bundle's (NOTE [bundles] in deliver/transport.py)."""
    from shardloader.deliver.transport import Bundle

    bundle = Bundle()
    for batch in batches:
        bundle.append(batch)
        if len(bundle) == k:
            yield bundle
            bundle = Bundle()
    if bundle:
        yield bundle


def _load_rows(
    ds: SampleSource,
    planner: TokenBlocks,
    plan: EpochPlan,
    steps: WorkerSteps,
    shards: Any,
    readahead: ReadAhead,
    worker: int | None,
    per: int,
) -> Iterator[Any]:
    """The load stage of token rows: a span of steps' rows sliced out of the staged shards
    (the token format's batch read), assembled ``per`` batches into one buffer (in a worker
    a bundle, yielded as one item).  (Assembling the next chunk in a thread while the loop
    runs was measured and dropped: the Python between numpy calls holds the GIL, so nothing
    overlapped and the hand-over cost 15 % more time per batch.)"""
    assert ds.lengths is not None  # TokenBlocks.bind had them loaded
    layout = planner.layout(ds.manifest.shard_sizes, ds.lengths)
    tokens = TokenRows(shards, ds.lengths, ds.manifest.shard_sizes)
    lean, first = None, per
    if planner.lean:  # the shards' own id dtype, from the manifest
        fields = ds.manifest.fields
        lean = token_dtype(fields.get(stream_field(fields) or ""))
        if worker is None:  # NOTE [lean chunks]
            size = planner.rows_per_batch * planner.seq_len * lean.itemsize
            per = max(per, min(_LEAN_CHUNK, _LEAN_BYTES // size))  # the first stays soon
    slots = plan.slots
    try:
        lo, n = 0, len(steps)
        while lo < n:
            hi = min(n, lo + (per * max(1, _SPAN // per) if lo else first))  # the first alone
            readahead.advance(int(steps.mine[hi - 1]))
            chosen, seeds = steps.window(lo, hi)
            repeated = seeds // slots.nodes >= slots.num_batches  # NOTE [flagged repeats]
            batches = [plan.batches[s] for s in chosen.tolist()]
            whole = chunk_layout(layout, batches, planner.rows_per_batch)
            loaded = tokens.load(whole.shard, whole.lo, whole.n)
            for a in range(0, hi - lo, per):
                b = min(a + per, hi - lo)
                part = whole.part(a, b)
                yield from build(planner, part, loaded, worker, ds.ring, repeated[a:b], lean)
            lo = hi
    finally:
        tokens.close()


# NOTE [lean chunks]
#     Without workers, lean token rows are assembled up to _LEAN_CHUNK batches (about
#     _LEAN_BYTES of ids) to a buffer, not _CHUNK: a lean buffer is small (uint16 ids: 8 MiB
#     for 256 batches of 8 x 2048), so what each chunk and span costs in Python (the buffer,
#     flags, cu_seqlens, views, the span's layout and token checks) is spread over more
#     batches, and copy_rows gathers the rows a shard at a time.  Measured (one process,
#     8 x 2048, CPU per batch): 8 batches 37.5 us, 64 28.3, 128 25.5, 256 23.0.  The first
#     chunk stays at _CHUNK batches, so the first batch is not later.
_LEAN_CHUNK, _LEAN_BYTES = 256, 8 << 20


def _collate(collate_fn: Callable[..., Any] | None, samples: list[Any], shards: Any) -> Any:
    """The batch; a missing value the collate cannot place gets its sample's shard named."""
    from shardloader.batching.default import torch_collate
    from shardloader.errors import MissingFieldError
    from shardloader.read.fields import placed

    try:
        return (collate_fn or torch_collate)(samples)
    except MissingFieldError as err:
        located = placed(err, shards)
        if located is err:
            raise
        raise located from err


def _working_set(ds: SampleSource, plan: EpochPlan, bounds: np.ndarray | None) -> int:
    """Staged bytes the pass keeps in use at once (``shards.working_set_bytes``); ``bounds``:
    the first row of each shard, when the plan batches token rows."""
    if is_lazy(plan):
        return pass_working_set(ds.manifest, ds.shuffle, plan, ds.read.readahead)
    reads = [batch_ids(b) for b in plan.batches]
    return working_set_bytes(ds.manifest, ds.shuffle, reads, ds.read.readahead, bounds)


def _shard_of(bounds: np.ndarray, units: np.ndarray) -> np.ndarray:
    """The shard of each unit (by the shards' first units, ``bounds``)."""
    return np.searchsorted(bounds, units, side="right") - 1


def _skipped(log: SkipLog, epoch: int, sample: int, key: str, place: Place, err: Any) -> None:
    log.record(epoch, place, sample, key, err)


def _read_ahead(
    shards: ShardSet, steps: Sequence[np.ndarray], j: int, into: dict[int, Rows], most: int
) -> Rows:
    """Read step ``j``'s batch, and with it up to ``most - 1`` next steps' as far as they need
    no shard that is not open yet (so nothing is staged earlier than before): one pass over
    each shard's rows serves several batches.  The first steps read fewer at a time (1, 2, 4,
    ...), so the first batch waits for its own samples only."""
    count = min(most, 1 << min(j, 8), len(steps) - j)
    count = 1 + shards.ready(steps[j + 1 : j + count])
    parts = shards.read_batches(steps[j : j + count])
    into.update(zip(range(j + 1, j + count), parts[1:], strict=True))
    return parts[0]


def _read_ahead_batches(manifest: Any, steps: Sequence[np.ndarray]) -> int:
    """How many batches :func:`_read_ahead` reads at once: up to :data:`_READ_AHEAD`, as long
    as they hold about :data:`_READ_AHEAD_BYTES` of samples (by the dataset's mean sample)."""
    if not steps:
        return 1
    mean = sum(s.raw_bytes for s in manifest.shards) / max(manifest.num_samples, 1)
    per_batch = mean * max(len(steps[0]), 1)
    return int(min(_READ_AHEAD, max(1, _READ_AHEAD_BYTES // max(per_batch, 1))))
