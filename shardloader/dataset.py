"""``ShardedDataset``: an IterableDataset that composes order, split, shards and decoding.

Guarantees (see DESIGN.md and README "Guarantees"): every sample exactly once per epoch across
ranks × workers (plus reported padding), the same number of steps on every rank, the same
sequence per rank whatever ``num_workers`` is, elastic and instant resume through
:func:`shardloader.make_loader`, and augmentation seeded per step.  The epoch plan is
:mod:`shardloader.epoch`'s, per-sample loading :mod:`shardloader.samples`'.
"""

from __future__ import annotations

import copy
import multiprocessing
import multiprocessing.context
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from shardloader.aliases import FieldMap
from shardloader.batching.base import batch_ids, check_positive
from shardloader.codecs import Decoder
from shardloader.epoch import EpochPlan, EpochPlanner, EpochReport, load_lengths
from shardloader.errors import UsageError
from shardloader.manifest import read_manifest
from shardloader.readahead import ReadAhead, node_schedule
from shardloader.samples import SampleLoader
from shardloader.shards import ReadOptions, ShardSet, working_set_bytes
from shardloader.shuffle import ShuffleOptions, batch_generator, derive_seed, seed_global_rngs
from shardloader.split import UNEVEN_POLICIES, Place, rank_slots
from shardloader.world import detect_place, detect_world, node_ranks

__all__ = ["ShardedDataset", "EpochReport"]

_EPOCH, _START, _RANK, _WORLD = range(4)
_DEFAULT_DECODER = Decoder()


class _Control:
    """Epoch, resume position, rank and world, readable by DataLoader workers.

    NOTE [why shared memory here]: with ``persistent_workers=True`` torch keeps the dataset
    copy the workers got at start, so ``set_epoch`` in the main process would never reach them.
    Four int64s in an anonymous shared array (inherited by workers, gone with the processes,
    nothing named to leak) carry it.  Outside process start-up the dataset pickles a snapshot.
    """

    def __init__(self, values: list[int]) -> None:
        self.array: Any = multiprocessing.RawArray("q", values)

    def get(self) -> list[int]:
        return list(self.array)

    def set(self, index: int, value: int) -> None:
        self.array[index] = value

    def __getstate__(self) -> dict[str, Any]:
        if multiprocessing.context.get_spawning_popen() is not None:
            return {"array": self.array}
        return {"values": list(self.array)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "array" in state:
            self.array = state["array"]
        else:
            self.array = multiprocessing.RawArray("q", state["values"])


class ShardedDataset(IterableDataset):  # type: ignore[type-arg]
    """Stream a packed dataset (local folder or any fsspec URL) into PyTorch.

    ``batch_size`` forms batches inside the workers (needed for the guarantee that a rank's
    sequence does not depend on ``num_workers``); ``planner`` replaces fixed batches with
    bucketing, token budgets or packing.  ``uneven`` says how ranks are evened out: ``"pad"``
    repeats samples, ``"drop"`` leaves them out; :meth:`report` gives the numbers.

    The planner decides the collate where it must agree with the plan (its
    ``resolve_collate``): ``PackedBatches(..., pad_id=...)`` builds its PackCollate when
    ``collate_fn`` is left out, and a PackCollate or PadCollate whose options disagree with the
    planner is refused.  Segment batches (see :mod:`shardloader.batching`) reach the collate as
    one sample per segment, the length field cut to the segment.
    """

    def __init__(
        self,
        url: str,
        *,
        batch_size: int | None = None,
        planner: Any = None,
        shuffle: bool | ShuffleOptions = False,
        seed: int = 0,
        uneven: str = "pad",
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        collate_fn: Callable[[list[dict[str, Any]]], Any] | None = None,
        decoder: Decoder | None = _DEFAULT_DECODER,
        on_error: str = "raise",
        rank: int | None = None,
        world_size: int | None = None,
        read: ReadOptions | None = None,
        aliases: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        super().__init__()
        if uneven not in UNEVEN_POLICIES:
            raise UsageError(f"uneven={uneven!r} is not one of {UNEVEN_POLICIES}")
        if on_error not in ("raise", "skip"):
            raise UsageError(f"on_error={on_error!r} is not 'raise' or 'skip'")
        if batch_size is not None and planner is not None:
            raise UsageError("pass batch_size or planner, not both")
        if batch_size is not None:
            check_positive("batch_size", batch_size)
        self.url = url
        self.read_options = read or ReadOptions()
        self.manifest, self.base = read_manifest(self.read_options.store(url))
        if self.manifest.num_samples == 0:
            raise UsageError(f"{url} holds no samples")
        self.batch_size = batch_size
        self.planner = planner
        self.shuffle = shuffle if isinstance(shuffle, ShuffleOptions) else ShuffleOptions(shuffle)
        self.seed = _integer("seed", seed)
        self.uneven = uneven
        self.transform = transform
        resolve = getattr(planner, "resolve_collate", None)
        self.collate_fn = (
            collate_fn if resolve is None else resolve(collate_fn, self.manifest.length_field)
        )
        self.decoder = decoder
        self.on_error = on_error
        # member extension → logical field: the manifest's aliases, ``aliases`` merged over
        self.field_map = FieldMap.of_manifest(self.manifest, aliases)
        self._planning.signature()  # a planner must declare its options (or fail here)
        self._bundle = 1  # batches per worker output: NOTE [bundles] in shardloader/transport.py
        self._ring: Any = None  # the loader's shared buffers (NOTE [ring slots] there)
        self._explicit_world = (rank, world_size)
        r, w = detect_world(rank, world_size)
        Place(r, w)  # validate
        self._control = _Control([0, 0, r, w])
        self._lengths: np.ndarray | None = None
        bind = getattr(planner, "bind", None)
        if bind is not None:  # a planner that reads the data itself checks it and loads lengths
            self._lengths = bind(self)  # (batching/blocks.py)
        elif planner is not None and getattr(planner, "needs_lengths", False):
            self._lengths = load_lengths(self.manifest, self.base, self.read_options)
        # len() of the last (epoch, start, rank, world) asked for: the loader checks every
        # pass against it; lengths loaded only for report(), never pickled into workers
        self._len_cache: tuple[tuple[int, ...], int] | None = None
        self._report_lengths: tuple[np.ndarray | None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_report_lengths"] = None
        return state

    # -- public state ---------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._control.get()[_EPOCH]

    @property
    def rank(self) -> int:
        return self._control.get()[_RANK]

    @property
    def world_size(self) -> int:
        return self._control.get()[_WORLD]

    @property
    def position(self) -> int:
        """Global batches of the current epoch the next pass skips (its resume point)."""
        return self._control.get()[_START]

    def resume_point(self) -> tuple[int, int]:
        """``(epoch, position)`` read together: where the next pass starts."""
        values = self._control.get()
        return values[_EPOCH], values[_START]

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (reshuffles); keeps a loaded resume position for that same epoch."""
        epoch = _integer("epoch", epoch)
        if epoch != self.epoch:
            self._control.set(_START, 0)
        self._control.set(_EPOCH, epoch)

    def seek(self, epoch: int, position: int) -> None:
        """Start the next pass of ``epoch`` after ``position`` global batches (all ranks).

        A rank's ``j``-th step of an epoch is global batch ``j * world_size + rank``, so to
        continue every rank at step ``j`` seek to ``position = j * world_size``.
        """
        epoch, position = _integer("epoch", epoch), _integer("position", position)
        if position < 0:
            raise UsageError(f"position must be >= 0, got {position}")
        self._control.set(_EPOCH, epoch)
        self._control.set(_START, position)

    def for_rank(self, rank: int, world_size: int) -> ShardedDataset:
        """A copy of this dataset (same manifest, seed, plan) that reads as ``rank``."""
        Place(rank, world_size)
        clone = copy.copy(self)
        clone._explicit_world = (rank, world_size)
        clone._control = _Control([self.epoch, 0, rank, world_size])
        return clone

    def refresh_world(self) -> None:
        """Re-detect rank/world (call after ``init_process_group``; make_loader does)."""
        r, w = detect_world(*self._explicit_world)
        self._control.set(_RANK, r)
        self._control.set(_WORLD, w)

    def use_transport(self, bundle: int, ring: Any) -> None:
        """Hand ``bundle`` batches over per DataLoader item, through ``ring``'s shared slots:
        set in each worker by :class:`~shardloader.loader.ShardLoader` (NOTE [bundles] in
        :mod:`shardloader.transport`), for planners that assemble batches themselves."""
        self._bundle, self._ring = bundle, ring

    @property
    def plan_signature(self) -> str:
        """What must stay equal for a saved position to mean the same samples: the planner's
        declared options (NOTE [plan signature] in :mod:`shardloader.batching.base`), shuffle
        and ``uneven``; ``fixed(N)`` stands for ``batch_size=N``."""
        return self._planning.signature()

    def global_batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """The epoch's global batches (sample ids ``[k]`` or segments ``[k, 3]``, see
        :mod:`shardloader.batching`) before ranks are evened out; pure, reads no shard."""
        return self._plan(self.epoch if epoch is None else epoch, 0, 0, 1).batches

    def report(self, epoch: int | None = None) -> EpochReport:
        """Steps per rank, samples padded/dropped/truncated and where every token goes (all
        ranks together) for an epoch; plans the epoch, reads nothing but the sidecar lengths."""
        current, position = self.resume_point()
        e = current if epoch is None else epoch
        plan = self._plan(e, position if e == current else 0, self.rank, self.world_size)
        lengths = self._lengths if self._lengths is not None else self._lengths_for_report()
        return self._planning.report(e, plan, lengths, self.collate_fn)

    def _lengths_for_report(self) -> np.ndarray | None:
        if self._report_lengths is None:
            lengths = None
            if self.manifest.length_field is not None:
                lengths = load_lengths(self.manifest, self.base, self.read_options, required=False)
            self._report_lengths = (lengths,)
        return self._report_lengths[0]

    def __len__(self) -> int:
        """Steps (batches, or samples when unbatched) this rank yields in the current epoch."""
        key = tuple(self._control.get())  # epoch, start, rank, world
        cached = self._len_cache
        if cached is None or cached[0] != key:
            steps = self._plan(*key).slots.steps_per_rank
            self._len_cache = cached = (key, steps)
        return cached[1]

    # -- planning (pure: shardloader.epoch) -----------------------------------------------
    @property
    def _planning(self) -> EpochPlanner:
        return EpochPlanner(
            self.manifest.shard_sizes,
            self.seed,
            self.shuffle,
            self.uneven,
            self.batch_size,
            self.planner,
        )

    def _plan(self, epoch: int, start: int, rank: int, world: int) -> EpochPlan:
        return self._planning.plan(epoch, start, rank, world, self._lengths)

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _readahead(
        self, shards: ShardSet, plan: EpochPlan, reads: list[np.ndarray], place: Place
    ) -> ReadAhead:
        """This node's read-ahead schedule (NOTE [node-wide read-ahead] in readahead.py)."""
        depth = self.read_options.readahead
        if shards.in_place or depth <= 0:
            return ReadAhead(shards, [], 0)
        ranks = node_ranks(place.rank, place.world_size)
        shard_ids, steps = [], []
        for r in ranks:
            mine = r == place.rank
            world = place.world_size
            slots = (
                plan.slots
                if mine
                else rank_slots(plan.num_batches, plan.start, r, world, self.uneven)
            ).slots
            parts = [reads[int(s)] for s in slots]
            ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            shard_ids.append(shards.locate(ids)[0])
            steps.append(np.repeat(np.arange(len(parts)), [len(p) for p in parts]))
        schedule = node_schedule(shard_ids, steps)
        return ReadAhead(shards, schedule, depth * len(ranks) * place.num_workers)

    def _iterate(self) -> Iterator[Any]:
        epoch, start, rank, world = self._control.get()
        place = detect_place(rank, world)
        seed_global_rngs(derive_seed(self.seed, epoch, place.rank, place.worker, 1 << 40))
        plan = self._plan(epoch, start, place.rank, place.world_size)
        if getattr(self.planner, "reads_token_stream", False):  # rows of token shards
            from shardloader.blockread import BlockSource, iterate_blocks

            assert self._lengths is not None  # the planner's bind() loaded them
            source = BlockSource(
                self.planner,
                self.manifest,
                self.base,
                self.read_options,
                self.shuffle,
                self._lengths,
                self._bundle,
                self._ring,
            )
            yield from iterate_blocks(source, plan, place)
            return
        mine = slice(place.worker, None, place.num_workers)
        slots, seeds = plan.slots.slots[mine], plan.slots.seeds[mine]
        reads = [batch_ids(b) for b in plan.batches]  # the samples each batch reads
        need = working_set_bytes(self.manifest, self.shuffle, reads, self.read_options.readahead)
        shards = ShardSet(self.manifest, self.base, self.read_options, str(place), need)
        loader = SampleLoader(
            self.field_map,
            self.decoder,
            self.transform,
            self.on_error,
            self.manifest.length_field,
            self._lengths,
        )
        try:
            readahead = self._readahead(shards, plan, reads, place)
            for j, (slot, seed_index) in enumerate(zip(slots, seeds, strict=False)):
                readahead.advance(j * place.num_workers + place.worker)  # this rank's step
                batch, ids = plan.batches[int(slot)], reads[int(slot)]
                seed_global_rngs(derive_seed(self.seed, epoch, int(seed_index)))
                generator = None
                if loader.takes_generator:
                    generator = batch_generator(self.seed, epoch, int(seed_index))
                pads = plan.pad_mask(int(slot), int(seed_index), len(ids))
                samples, substituted = loader.load_batch(shards, ids, pads, place, generator)
                if batch.ndim == 2:
                    samples = loader.cut_segments(batch, ids, samples, substituted, place)
                if self.batch_size is None and self.planner is None:
                    if samples:
                        yield samples[0]
                elif self.collate_fn is not None:
                    yield self.collate_fn(samples)
                else:
                    from torch.utils.data import default_collate

                    yield default_collate(samples)
        finally:
            shards.close()


def _integer(name: str, value: Any) -> int:
    """``int(value)`` as before, but a value that is no integer is a UsageError naming it."""
    try:
        return int(value)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{name} must be an integer, got {value!r}") from err
