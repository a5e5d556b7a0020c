"""``ShardedDataset``: an IterableDataset that composes order, split, shards and decoding.

Guarantees (see DESIGN.md and README "Guarantees"): every sample exactly once per epoch across
ranks × workers (plus reported padding), the same number of steps on every rank, the same
sequence per rank whatever ``num_workers`` is, elastic and instant resume through
:func:`shardloader.make_loader`, and augmentation seeded per step.  The epoch plan is
:mod:`shardloader.plan.epoch`'s, a pass :mod:`shardloader.read.samplepass`'s (samples, or rows
of token shards), per-sample loading :mod:`shardloader.read.loading`'s.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from functools import cached_property, partial
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from shardloader.batching.base import check_planner, check_positive
from shardloader.codecs.allowlist import Decoder
from shardloader.deliver.position import DatasetPosition, integer
from shardloader.deliver.watchdog import watched
from shardloader.errors import UsageError
from shardloader.manifest import read_manifest
from shardloader.options import ReadOptions, ShuffleOptions, World, from_old_keywords
from shardloader.plan.elastic import Reshape, elastic_field, saved_shape
from shardloader.plan.epoch import EpochPlan, EpochPlanner, EpochReport
from shardloader.plan.ledger import Ledger
from shardloader.plan.shuffle import derive_seed
from shardloader.plan.split import UNEVEN_POLICIES, Place
from shardloader.read.fields import FieldMap
from shardloader.read.lengths import load_lengths
from shardloader.read.loading import SampleLoader
from shardloader.read.openpasses import noted
from shardloader.read.samplepass import PassInputs, run_pass
from shardloader.read.seeding import seed_global_rngs
from shardloader.read.shardset import ShardSet
from shardloader.read.skips import SkipLog
from shardloader.world import detect_place

__all__ = ["ShardedDataset", "EpochReport", "Packed"]

_DEFAULT_DECODER = Decoder()


class Packed:
    """What a dataset reads: a packed dataset's manifest, its folder and how its shards are
    fetched (a :class:`~shardloader.mixture.Mixture` reads its blend of several instead)."""

    def __init__(self, url: str, read: ReadOptions) -> None:
        self.url, self.read = url, read
        self.manifest, self.base = read_manifest(read.store(url))

    def lengths(self, required: bool) -> np.ndarray | None:
        """Every sample's recorded length by global id (:func:`load_lengths`)."""
        return load_lengths(self.manifest, self.base, self.read, required=required)

    def shard_set(self, where: str, working_set: int) -> Any:
        """What a pass reads samples through, by global id."""
        return ShardSet(self.manifest, self.base, self.read, where, working_set)

    def order(self, dataset: Any) -> Any:
        """What replaces the epoch order for ``dataset`` (``partitioned(epoch, nodes)``, see
        :class:`~shardloader.plan.epoch.EpochPlanner`); None: the shuffle's."""
        return None

    def extra_state(self, dataset: Any) -> dict[str, Any]:
        """What ``dataset``'s loader state adds to its position (a blend: the weights)."""
        return {}

    def load_extra_state(
        self, dataset: Any, state: Mapping[str, Any], epoch: int, position: int
    ) -> None:
        """Replay what :meth:`extra_state` saved in a state resumed at ``epoch``, ``position``."""


class ShardedDataset(DatasetPosition, IterableDataset):  # type: ignore[type-arg]
    """Stream a packed dataset (local folder or any fsspec URL) into PyTorch.

    ``batch_size`` forms batches inside the workers (needed for the guarantee that a rank's
    sequence does not depend on ``num_workers``); ``planner`` replaces fixed batches with
    bucketing, token budgets or packing.  ``uneven`` says how ranks are evened out: ``"pad"``
    repeats samples, ``"drop"`` leaves them out; :meth:`report` gives the numbers.

    ``world``: where this process reads in the job, a :class:`~shardloader.options.World`
    (rank and world size, ranks per node, which share of an epoch a node reads, or the job's
    data-parallel group); detected when left out.  ``read``: how shards are fetched and which
    member extensions are one field (:class:`~shardloader.options.ReadOptions`).  The keywords
    ``rank``, ``world_size``, ``ranks_per_node``, ``partition``, ``data_parallel`` and
    ``aliases`` still work for a release, with a DeprecationWarning naming the replacement.

    The planner decides the collate where it must agree with the plan (its
    ``resolve_collate``): ``PackedBatches(..., pad_id=...)`` builds its PackCollate when
    ``collate_fn`` is left out, and a PackCollate or PadCollate whose options disagree with the
    planner is refused.  Segment batches (see :mod:`shardloader.batching`) reach the collate as
    one sample per segment, the length field cut to the segment.

    ``url``: a packed dataset's folder or fsspec URL, or what a dataset reads in its place (a
    :class:`Packed`: a :class:`~shardloader.mixture.Mixture` passes its blend of sources).
    """

    def __init__(
        self,
        url: str | Packed,
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
        read: ReadOptions | None = None,
        world: World | None = None,
        **deprecated: Any,
    ) -> None:
        super().__init__()
        world, read = from_old_keywords(world, read, deprecated, type(self).__name__)
        if uneven not in UNEVEN_POLICIES:
            raise UsageError(f"uneven={uneven!r} is not one of {UNEVEN_POLICIES}")
        if on_error not in ("raise", "skip"):
            raise UsageError(f"on_error={on_error!r} is not 'raise' or 'skip'")
        if batch_size is not None and planner is not None:
            raise UsageError("pass batch_size or planner, not both")
        if batch_size is not None:
            check_positive("batch_size", batch_size)
        self._source = url if isinstance(url, Packed) else Packed(url, read)
        self.url, self.read_options, self.manifest = self._source.url, read, self._source.manifest
        if self.manifest.num_samples == 0:
            raise UsageError(f"{self.url} holds no samples")
        self.batch_size = batch_size
        self.planner = check_planner(planner)
        self.shuffle = shuffle if isinstance(shuffle, ShuffleOptions) else ShuffleOptions(shuffle)
        self.seed = integer("seed", seed)
        self.uneven = uneven
        self.transform = transform
        self.collate_fn = (
            collate_fn
            if self.planner is None
            else self.planner.resolve_collate(collate_fn, self.manifest.length_field)
        )
        self.decoder = decoder
        self.on_error = on_error
        # member extension → logical field: the manifest's aliases, ``aliases`` merged over
        self.field_map = FieldMap.of_manifest(self.manifest, read.aliases).only(read.fields)
        self._init_position(world)
        self._planning.signature()  # a planner must declare its options (or fail here)
        # batches per worker output: NOTE [bundles] in shardloader/deliver/transport.py
        self._bundle = 1
        self._ring: Any = None  # the loader's shared buffers (NOTE [ring slots] there)
        self._skip_log: SkipLog | None = None  # read/skips.py: where run-time skips go
        self._lengths: np.ndarray | None = None
        if self.planner is not None:  # a planner that reads the data itself checks it and
            self._lengths = self.planner.bind(self)  # loads lengths (batching/blocks.py)
            if self._lengths is None and self.planner.needs_lengths:
                self._lengths = self._source.lengths(required=True)
        self._plan_cache: tuple[tuple[Any, ...], EpochPlan] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_lengths_for_report", None)  # loaded only for report(), never in workers
        state["_plan_cache"] = None
        state["_progress"] = state["_pending"] = None  # per process (NOTE [worker states])
        return state

    def raw_bundle(self) -> int:
        """Raw batches per worker output (NOTE [raw bundles] in
        :mod:`shardloader.batching.raw`): asked by the loader, which knows no collate."""
        from shardloader.batching.raw import raw_bundle

        return raw_bundle(self)

    def use_transport(self, bundle: int, ring: Any) -> None:
        """Hand ``bundle`` batches over per DataLoader item, through ``ring``'s shared slots:
        set in each worker by :class:`~shardloader.deliver.loader.ShardLoader` (NOTE [bundles] in
        :mod:`shardloader.deliver.transport`), for planners that assemble batches themselves,
        and (``bundle`` 1) for image batches of a fixed shape, stacked into the slots
        (:mod:`shardloader.deliver.slotcollate`)."""
        self._bundle, self._ring = bundle, ring
        if bundle == 1 and ring is not None:  # image batches (deliver/slotcollate.py)
            from shardloader.batching.default import torch_collate
            from shardloader.deliver.slotcollate import SlotCollate, fixed_output

            out = fixed_output(self.transform)
            if out is not None and self.collate_fn is None:
                self.collate_fn = SlotCollate(torch_collate, ring, out[0])

    @property
    def plan_signature(self) -> str:
        """What must stay equal for a saved position to mean the same samples: the planner's
        declared options (NOTE [plan signature] in :mod:`shardloader.batching.base`), shuffle
        and ``uneven``; ``fixed(N)`` stands for ``batch_size=N``."""
        return self._planning.signature()

    def global_batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """The epoch's global batches (sample ids ``[k]`` or segments ``[k, 3]``, see
        :mod:`shardloader.batching`) of one partition, before ranks are evened out; pure,
        reads no shard."""
        return list(self._plan(self.epoch if epoch is None else epoch, 0, 0, 1).batches)

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """This rank's plan of an epoch (its partition's batches and the rank's slots in
        them), the current one as resumed, any other from its start; pure, reads no shard."""
        e, position, history = self._where(epoch)
        return self._plan(e, position, self.rank, self.world_size, history)

    def report(self, epoch: int | None = None) -> EpochReport:
        """Steps per rank, samples padded/dropped/truncated and where every token goes (all
        ranks together) for an epoch; plans the epoch, reads nothing but the sidecar lengths."""
        e, plans = self._epoch_plans(epoch)
        lengths = self._lengths_for_report
        report = self._planning.report(e, plans, lengths, self.collate_fn)
        from shardloader.plan.cost import rank_balance  # packed rows' step cost

        balance = rank_balance(self._planning, e, self.partition, lengths)
        return dataclasses.replace(report, rank_balance=balance)

    def ledger(self, epoch: int | None = None) -> Ledger:
        """Which samples of an epoch are padded, dropped or truncated, and why: computed from
        the plan like :meth:`report` (every rank gets the same, without talking); add the
        run-time skips :meth:`record_skips` collected with ``ledger.with_skips(
        shardloader.read.skips.merge_skips(directory, epoch))`` (NOTE [the ledger comes from the
        plan] in :mod:`shardloader.plan.ledger`)."""
        from shardloader.plan.ledger import build

        e, plans = self._epoch_plans(epoch)
        lengths = self._lengths_for_report
        return build(e, self.world_size, self._planning, plans, lengths, self.collate_fn)

    def _epoch_plans(self, epoch: int | None) -> tuple[int, list[EpochPlan]]:
        """Every partition's plan of an epoch: the current one as resumed (its position and
        reshapes), any other from its start."""
        e, position, history = self._where(epoch)
        return e, self._planning.cluster(e, position, self.partition, self._lengths, history)

    def reshaped_from(self, saved_plan: str) -> int | None:
        """The batch shape a saved plan signature was made with, when it is this dataset's
        plan with only the elastic option changed (else None): what a resume may re-cut."""
        return saved_shape(self._planning, saved_plan)

    @property
    def elastic_option(self) -> str | None:
        """The option a resume may change (``batch_size``, the planner's ``elastic``), or
        None when the planner cannot change its batch shape mid-epoch."""
        return elastic_field(self._planning)

    def record_skips(self, directory: str | None) -> None:
        """Append every sample ``on_error="skip"`` replaces to ``directory/skips-rank<R>.jsonl``
        (one small file per rank, written by its workers); ``None`` stops.  Call before
        iterating: workers take the setting when they start."""
        self._skip_log = None if directory is None else SkipLog(os.fspath(directory))

    @cached_property
    def _lengths_for_report(self) -> np.ndarray | None:
        """The planner's lengths, else the sidecars' (loaded once, when recorded)."""
        if self._lengths is not None or self.manifest.length_field is None:
            return self._lengths
        return self._source.lengths(required=False)

    def __len__(self) -> int:
        """Steps (batches, or samples when unbatched) this rank yields in the current epoch
        (its plan is kept: the loader checks the pass it starts against it)."""
        return self.plan().slots.steps_per_rank

    # -- planning (pure: shardloader.plan.epoch) -----------------------------------------------
    @property
    def _planning(self) -> EpochPlanner:
        return EpochPlanner(
            self.manifest.shard_sizes,
            self.seed,
            self.shuffle,
            self.uneven,
            self.batch_size,
            self.planner,
            self._source.order(self),
        )

    def _plan(
        self,
        epoch: int,
        start: int,
        rank: int,
        world: int,
        reshapes: tuple[Reshape, ...] = (),
    ) -> EpochPlan:
        """The plan of a pass in this dataset's partitions of ``world``; the last one is kept
        (``len()`` and the pass after it plan the same pass in the same process), never
        pickled into workers."""
        planning = self._planning
        part = self.partition if world == self.world_size else self._partition_of(world, None)
        key: tuple[Any, ...] = (epoch, start, rank, world, part, self.seed, planning.signature())
        # a mixture's order source carries its weights (hashable, by value)
        key += (id(self._lengths), planning.order_source, *reshapes)
        cached = self._plan_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        plan = planning.plan(epoch, start, rank, world, self._lengths, reshapes, part)
        self._plan_cache = (key, plan)
        return plan

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        # the pass is recorded now, not at the first batch: a StatefulDataLoader asks for
        # the state before it (NOTE [worker states] in shardloader/deliver/position.py)
        place = detect_place(self.rank, self.world_size)
        progress, place, epoch, start = self._begin_pass(place)
        if progress.done >= progress.steps:
            return iter(())
        # NOTE [closing a pass left early] in shardloader/read/openpasses.py
        passes = self._iterate(place, epoch, start, progress.reshapes)
        passes = noted(watched(passes, self.read_options.stall_timeout, place))
        return self._counted(progress, passes)

    @staticmethod
    def _counted(progress: Any, items: Iterator[Any]) -> Iterator[Any]:
        for item in items:
            progress.done += 1
            yield item

    def _iterate(
        self, place: Place, epoch: int, start: int, history: tuple[Reshape, ...]
    ) -> Iterator[Any]:
        seed_global_rngs(derive_seed(self.seed, epoch, place.rank, place.worker, 1 << 40))
        plan = self._plan(epoch, start, place.rank, place.world_size, history)
        rows: Any = None  # a TokenBlocks: its units are rows of token shards
        if self.planner is not None and self.planner.units == "rows":
            rows = self.planner
        skipped = None if self._skip_log is None else partial(self._skip_log.record, epoch)
        inputs = PassInputs(
            self.manifest,
            self.seed,
            self.read_options.readahead,
            self.partition,
            self._ranks_per_node,
            self.shuffle,
            self._source.shard_set,
            SampleLoader(
                self.field_map,
                self.decoder,
                self.transform,
                self.on_error,
                self.manifest.length_field,
                self._lengths,
                skipped,
            ),
            self.collate_fn,
            self.batch_size is not None or self.planner is not None,
            rows=rows,
            bundle=self._bundle,
            ring=self._ring,
        )
        yield from run_pass(inputs, plan, place, epoch)
