"""One pass in one process: the worker's steps read ahead, loaded and collated.

The dataset plans the epoch (:mod:`shardloader.plan.epoch`) and hands :func:`run_pass` the plan
and the pass's inputs (:class:`PassInputs`).  The pass composes its stages, each taking only
its own inputs: this worker's steps (:class:`~shardloader.plan.steps.WorkerSteps`, worked out
as walked) → read-ahead (:func:`~shardloader.read.readahead.pass_readahead`: schedule, depth)
→ shards (``open_shards``: store, node cache) → load and collate, by the plan's *units*:

* samples: the batch is read with up to 15 more whose shards are open already
  (:func:`_read_ahead`), loaded by a :class:`~shardloader.read.loading.SampleLoader` (decode,
  seeded transform, ``on_error``) and collated;
* rows of token shards (a :class:`~shardloader.batching.blocks.TokenBlocks` planner, NOTE [what
  a row is] there): a span of batches is sliced out of the staged shards' memory maps
  (:class:`~shardloader.format.tokens.rows.TokenRows`, checked chunk by chunk) and assembled a
  chunk (a bundle, in a worker) at a time by TokenBlocks' collate
  (:func:`~shardloader.batching.blockchunks.build`): no sample is read, decoded or collated.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.batching.blockchunks import build, chunk_layout
from shardloader.batching.raw import RawCollate
from shardloader.errors import MissingFieldError
from shardloader.format.base import Rows
from shardloader.format.tokens.layout import stream_field, token_dtype
from shardloader.format.tokens.rows import TokenRows
from shardloader.plan.partition import Partition
from shardloader.plan.shuffle import derive_seeds, transform_seeds
from shardloader.plan.steps import StepSeeds, WorkerSteps
from shardloader.read.loading import SampleLoader, pipeline_draws
from shardloader.read.readahead import pass_readahead
from shardloader.read.seeding import generator_of, seed_global_rngs
from shardloader.read.shardset import working_set_bytes

if TYPE_CHECKING:
    from shardloader.batching.blocks import RowLayout, TokenBlocks
    from shardloader.manifest import Manifest
    from shardloader.plan.epoch import EpochPlan
    from shardloader.plan.shuffle import ShuffleOptions
    from shardloader.plan.split import Place
    from shardloader.read.readahead import ReadAhead
    from shardloader.read.shardset import ShardSet

__all__ = ["PassInputs", "run_pass"]

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
class PassInputs:
    """What a pass takes from the dataset (which keeps its state to itself), by stage."""

    manifest: Manifest
    seed: int  # the run's: each step's seeds derive from it
    readahead: int  # read-ahead: shards staged ahead (ReadOptions.readahead)
    partition: Partition  # read-ahead: how the world is cut (shardloader.plan.partition)
    ranks_per_node: int | None  # read-ahead: as the dataset resolved its world (None: unknown)
    shuffle: ShuffleOptions  # shards: the working set the node cache must hold
    open_shards: Callable[[str, int], Any]  # shards: (place, working set) -> ShardSet
    load: SampleLoader  # load: fields, decoder, transform, on_error, the plan's lengths
    collate_fn: Callable[[list[dict[str, Any]]], Any] | None  # collate (None: the default)
    batched: bool  # batch_size or a planner: steps are batches, else single samples
    rows: TokenBlocks | None = None  # the planner, when its units are token rows
    bundle: int = 1  # row batches per worker output (NOTE [bundles] in deliver/transport.py)
    ring: Any = None  # the loader's shared buffers (NOTE [ring slots] there)


def run_pass(inputs: PassInputs, plan: EpochPlan, place: Place, epoch: int) -> Iterator[Any]:
    """Yield this worker's batches (or samples, unbatched; or bundles of batches) of the
    planned pass of ``epoch``: steps → read-ahead → shards → load → collate."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    worker = None if info is None else int(info.id)
    # bundles: of row batches, or of raw batches (NOTE [raw bundles] in batching/raw.py)
    bundle = max(inputs.bundle, 1) if worker is not None else 1
    steps = WorkerSteps(plan, place.worker, place.num_workers, bundle)  # worked out as walked
    layout, shard_of = None, None
    if inputs.rows is not None:  # a row's shard: by the rows' bounds (batching/blocks.py)
        layout = inputs.rows.layout(inputs.manifest.shard_sizes, inputs.load.lengths)
        shard_of = functools.partial(_shard_of, layout.row_bounds)
    bounds = None if layout is None else layout.row_bounds
    working = working_set_bytes(inputs.manifest, inputs.shuffle, plan, inputs.readahead, bounds)
    shards = inputs.open_shards(str(place), working)
    try:
        ahead = pass_readahead(
            shards,
            plan,
            place,
            inputs.readahead,
            inputs.partition,
            inputs.ranks_per_node,
            shard_of,
        )
        if layout is None:
            batches = _load_samples(inputs, plan, place, epoch, steps, shards, ahead)
            yield from batches if bundle == 1 else _bundled(batches, bundle)
        else:
            per = bundle if worker is not None else _CHUNK
            yield from _load_rows(inputs, layout, plan, steps, shards, ahead, worker, per)
    finally:
        shards.close()


def _load_samples(
    inputs: PassInputs,
    plan: EpochPlan,
    place: Place,
    epoch: int,
    steps: WorkerSteps,
    shards: Any,
    readahead: ReadAhead,
) -> Iterator[Any]:
    """The load and collate stages of samples: read, decode, transform (seeded per step)."""
    loader, collate_fn, seed = inputs.load, inputs.collate_fn, inputs.seed
    # NOTE [what the global seeds are for]: torch/numpy/random are seeded per batch only
    # for code that may draw from them (a transform, custom decoders, a collate that is
    # not shardloader's: pipeline_draws); shardloader's own parts never do, so a pipeline
    # of those alone skips the ~20 us a batch costs.  Seeds are derived for a window of
    # steps at once (derive_seeds gives exactly derive_seed's values).
    global_seeds = None
    offset = plan.seed_offset  # after a batch-shape change: fresh numbers
    if pipeline_draws(loader.transform, loader.decoder, collate_fn):
        global_seeds = StepSeeds(steps, lambda q: derive_seeds(seed, epoch, q + offset))
    generator_seeds = None
    if loader.takes_generator:
        generator_seeds = StepSeeds(steps, lambda q: transform_seeds(seed, epoch, q + offset))
    raw = (
        isinstance(collate_fn, RawCollate)
        and loader.decoder is None
        and loader.transform is None
        and inputs.batched
    )
    read: dict[int, Rows] = {}  # batches read ahead (see _read_ahead)
    most = _read_ahead_batches(inputs.manifest, steps)
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
            yield loader.load_raw(shards, ids, rows, pads, place)
            continue
        generator = None if generator_seeds is None else generator_of(generator_seeds[j])
        samples, substituted = loader.load_batch(shards, ids, rows, pads, place, generator)
        if batch.ndim == 2:
            samples = loader.cut_segments(batch, ids, samples, substituted, place)
        if not inputs.batched:
            if samples:
                yield samples[0]
        else:
            yield _collate(collate_fn, samples, shards)


def _bundled(batches: Iterator[Any], k: int) -> Iterator[Any]:
    """``batches`` as bundles of ``k`` (the last may hold fewer): a worker's steps come in
    whole bundles of consecutive rank steps (WorkerSteps), so its ``k`` consecutive batches
    are one bundle's (NOTE [bundles] in deliver/transport.py)."""
    from shardloader.deliver.transport import Bundle

    while bundle := Bundle(itertools.islice(batches, k)):
        yield bundle


def _load_rows(
    inputs: PassInputs,
    layout: RowLayout,
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
    planner, lengths, manifest = inputs.rows, inputs.load.lengths, inputs.manifest
    assert planner is not None and lengths is not None  # TokenBlocks.bind had them loaded
    tokens = TokenRows(shards, lengths, manifest.shard_sizes)
    lean, first = None, per
    if planner.lean:  # the shards' own id dtype, from the manifest
        fields = manifest.fields
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
                yield from build(planner, part, loaded, worker, inputs.ring, repeated[a:b], lean)
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

    try:
        return (collate_fn or torch_collate)(samples)
    except MissingFieldError as err:
        # the first sample lacking the field, by its id (None: a transform dropped __index__)
        if err.index is not None and err.where is None:
            with contextlib.suppress(IndexError, ValueError):
                shard = shards.locate(np.asarray([err.index], np.int64))[0][0]
                err.where = shards.describe(int(shard))
        raise


def _shard_of(bounds: np.ndarray, units: np.ndarray) -> np.ndarray:
    """The shard of each unit (by the shards' first units, ``bounds``)."""
    return np.searchsorted(bounds, units, side="right") - 1


def _read_ahead(
    shards: ShardSet, steps: Sequence[np.ndarray], j: int, into: dict[int, Rows], most: int
) -> Rows:
    """Read step ``j``'s batch, and with it up to ``most - 1`` next steps' as far as they need
    no shard that is not open yet (so nothing is staged earlier than before): one pass over
    each shard's rows serves several batches.  The first steps read fewer at a time (1, 2, 4,
    ...), so the first batch waits for its own samples only.  The batches are read as one
    (each shard's rows of all of them together share its handful of numpy calls)."""
    count = min(most, 1 << min(j, 8), len(steps) - j)
    count = 1 + shards.ready(steps[j + 1 : j + count])
    if count == 1:
        return shards.read_batch(steps[j])
    batches = steps[j : j + count]
    parts = shards.read_batch(np.concatenate(batches)).split([len(b) for b in batches])
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
