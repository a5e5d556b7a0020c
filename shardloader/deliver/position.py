"""Where a dataset stands: epoch, resume position, rank, world and its partitions, shared with
its DataLoader workers, and each process's own pass (the dataset's ``state_dict``).

NOTE [why shared memory here]: with ``persistent_workers=True`` torch keeps the dataset copy the
workers got at start, so ``set_epoch`` in the main process would never reach them.  A few int64s
in an anonymous shared array (:class:`Control`: inherited by workers, gone with the processes,
nothing named to leak) carry the epoch, position, rank and world (and a mixture's weight
schedule, a resume's reshape history).  Outside process start-up the dataset pickles a snapshot.
:class:`DatasetPosition` is the part of :class:`~shardloader.dataset.ShardedDataset` that owns
them; a position counted in other partitions than the current ones (a resume, a world that
changed) becomes a link of the epoch's history here (NOTE [reshape history] in
:mod:`shardloader.plan.elastic`), so every planning path sees one consistent ``(epoch, position,
reshapes)``.

NOTE [worker states]
    ``StatefulDataLoader`` asks the dataset for its state after every batch, in the process
    that made the batch, and on resume hands each worker its own state back before that worker
    calls ``iter(dataset)``; the main process never sees the workers' datasets.  A worker knows
    only its own progress: rank step ``j`` belongs to worker ``j mod K`` (DESIGN.md, "Order and
    split" 3), so its state is its pass (epoch, the pass's start in global batches, reshapes,
    partitions), its place (rank, world size, worker, workers) and ``steps``, its own steps
    handed out, ``m``.  Resumed, worker ``w`` reads its steps from ``w + m*K`` on: the pass
    planned from ``start + m*K*W`` global batches, read as worker ``w`` (steps renumbered by a
    multiple of ``K`` keep their worker).  The loader resumes its round robin at the worker
    after the last one it took a batch from, so together the workers yield exactly the steps
    not yet handed out.  That needs the world and ``num_workers`` the state was saved with: a
    worker checks both (ResumeError).  Without workers the dataset's state is the loader's
    (:mod:`shardloader.deliver.loaderstate`), elastic; but after the pass's last step it names the
    epoch it finished, at its end (``make_loader``'s names the next epoch), so both kinds
    resume alike: ``set_epoch`` to that epoch yields nothing more of it, to the next one starts
    it (in order: with workers the next pass starts at the worker the round robin comes to).
    A worker writes nothing of the dataset's shared control block: what it loads stays in its
    own copy, for its next pass of that epoch; a pass of another epoch drops it (as
    ``set_epoch`` to another epoch drops a loaded position).
"""

from __future__ import annotations

import copy
import multiprocessing
import multiprocessing.context
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardloader.deliver.loaderstate import make_state, read_state, resume
from shardloader.errors import ResumeError, UsageError
from shardloader.options import World
from shardloader.plan.elastic import Reshape, encode_history, history_of, shape_of
from shardloader.plan.partition import Partition, choose_partition
from shardloader.plan.split import Place
from shardloader.world import detect_ranks_per_node, resolve_world

__all__ = ["Control", "DatasetPosition", "integer"]

# the shared control block: epoch, position, rank, world size, ranks per node (0: unknown), the
# partitions the position was counted in (0: the current ones), then the epoch's reshape history
# (NOTE [reshape history] in shardloader/plan/elastic.py)
_EPOCH, _START, _RANK, _WORLD, _PER_NODE, _START_NODES, _HISTORY = range(7)


class Control:
    """Integers set in the main process and read by DataLoader workers (NOTE [why shared
    memory here])."""

    def __init__(self, values: list[int]) -> None:
        self.array: Any = multiprocessing.RawArray("q", values)

    def get(self) -> list[int]:
        return list(self.array)

    def update(self, values: Mapping[int, int]) -> None:
        """Set several values at once: ``{index: value}``."""
        for index, value in values.items():
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


@dataclass
class _Pass:
    """The pass a process is walking, and how many of its own steps it handed out."""

    epoch: int
    start: int  # global batches before the pass, counted in ``partitions``
    reshapes: tuple[Reshape, ...]
    partitions: int
    place: Place  # the process's own rank, world, worker and workers
    steps: int  # this process's steps of the pass
    done: int = 0
    rotation: int = 0  # worker w reads the steps of worker w - rotation (NOTE [worker states])
    batches: int = 0  # the partition's batches in the pass's plan


class DatasetPosition:
    """Epoch, position, world and partitions of a dataset, shared with its workers, and the
    pass this process walks (its ``state_dict``, NOTE [worker states])."""

    partition_mode: str
    manifest: Any
    _planning: Any
    _plan: Any  # ShardedDataset's: the plan of a pass
    _source: Any  # ShardedDataset's: what it reads (its extra state)
    _progress: _Pass | None = None  # the pass this process walks
    _pending: _Pass | None = None  # a worker's loaded state, for its next pass

    def _init_position(self, world: World) -> None:
        self._control = Control([0, 0, 0, 1, 0, 0, *encode_history(())])
        self.set_world(world, settle=False)

    def set_world(self, world: World, *, settle: bool = True) -> None:
        """Read from now on where ``world`` says (a :class:`~shardloader.options.World`:
        detected, a rank of a world size, or this rank's replica of a data-parallel group); a
        position counted in other partitions is re-planned."""
        self.partition_mode = world.partition
        # what refresh_world re-detects from; None: a place read once, from the group (a
        # dataset never holds a group: it must pickle into workers)
        self._world: World | None = None if world.group is not None else world
        r, w, per_node = resolve_world(world)
        self._control.update({_RANK: r, _WORLD: w, _PER_NODE: per_node or 0})
        if settle:
            self._settle()

    def set_data_parallel(self, group: Any, ranks_per_node: int | None = None) -> None:
        """Deprecated: ``set_world(World.of(group, ranks_per_node=...))``."""
        warnings.warn(
            "set_data_parallel(group) is deprecated and goes in the next release: pass "
            "world=shardloader.World.of(group) to the dataset, or call "
            "set_world(shardloader.World.of(group))",
            DeprecationWarning,
            stacklevel=2,
        )
        self.set_world(
            World.of(group, ranks_per_node=ranks_per_node, partition=self.partition_mode)
        )

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
    def partition(self) -> Partition:
        """How the current world is cut into partitions (NOTE [node partitions] in
        :mod:`shardloader.plan.partition`)."""
        values = self._control.get()
        return self._partition_of(values[_WORLD], values[_PER_NODE] or None)

    @property
    def _ranks_per_node(self) -> int | None:
        """Ranks (with a data-parallel group: replicas) on each node, as the world was
        resolved (:func:`~shardloader.world.resolve_world`); None: unknown."""
        return self._control.get()[_PER_NODE] or None

    def _partition_of(self, world: int, per_node: int | None) -> Partition:
        return choose_partition(self.partition_mode, world, per_node, self.manifest.num_samples)

    @property
    def position(self) -> int:
        """Global batches of the current epoch the next pass skips (its resume point)."""
        return self._where()[1]

    def resume_point(self) -> tuple[int, int]:
        """``(epoch, position)`` read together: where the next pass starts."""
        return self._where()[:2]

    def _where(self, epoch: int | None = None) -> tuple[int, int, tuple[Reshape, ...]]:
        """``(epoch, position, reshapes)`` of the next pass in the current partitions: a
        position counted in other partitions (a resume, or a world that changed) becomes a
        link of the epoch's history, and the rest is planned afresh (NOTE [reshape history]
        in :mod:`shardloader.plan.elastic`).  ``epoch``: another epoch than the current one
        is planned from its start."""
        values = self._control.get()
        current, start, counted = values[_EPOCH], values[_START], values[_START_NODES]
        if epoch is not None and integer("epoch", epoch) != current:
            return int(epoch), 0, ()
        history = history_of(values[_HISTORY:])
        nodes = self._partition_of(values[_WORLD], values[_PER_NODE] or None).nodes
        if start and counted and counted != nodes:
            shape = shape_of(self._planning) or 0
            history += ((shape, start) if counted == 1 else (shape, counted, start),)
            start = 0
        return current, start, history

    def _settle(self) -> None:
        """Write :meth:`_where` back, counted in the current partitions."""
        epoch, start, history = self._where()
        nodes = self.partition.nodes
        self._control.update({_START: start, _START_NODES: nodes, **_history(history)})

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (reshuffles); keeps a loaded resume position for that same epoch."""
        epoch = integer("epoch", epoch)
        if epoch != self.epoch:  # the last pass's progress no longer applies
            self.seek(epoch, 0)

    def seek(
        self,
        epoch: int,
        position: int,
        reshapes: Sequence[Reshape] = (),
        partitions: int | None = None,
    ) -> None:
        """Start the next pass of ``epoch`` after ``position`` global batches (all ranks).

        A rank's ``j``-th step of an epoch follows ``j * world_size`` global batches, so to
        continue every rank at step ``j`` seek to ``position = j * world_size``.
        ``reshapes`` (what ``load_state_dict`` passes after a batch-shape change) are the
        epoch's earlier links; ``position`` then counts batches of the rest, re-planned for
        the current shape (NOTE [reshape history] in :mod:`shardloader.plan.elastic`).
        ``partitions``: how many partitions the position was counted in (default: the
        current ones); another count re-plans the rest for the current partitions.
        """
        epoch, position = integer("epoch", epoch), integer("position", position)
        if position < 0:
            raise UsageError(f"position must be >= 0, got {position}")
        nodes = 0 if partitions is None else integer("partitions", partitions)
        history = _history(reshapes)
        self._progress = None
        self._control.update({_EPOCH: epoch, _START: position, _START_NODES: nodes, **history})

    @property
    def reshapes(self) -> tuple[Reshape, ...]:
        """The current epoch's earlier links (empty unless a resume changed the batch shape
        or the partitions): ``((shape, global batches consumed), ...)``, or ``(shape,
        partitions, global batches consumed)`` for a link read in several partitions."""
        return self._where()[2]

    @property
    def shape(self) -> int | None:
        """The value of the option a resume may change (``batch_size``, the planner's
        ``elastic`` option), or None for a planner that cannot change shape."""
        return shape_of(self._planning)

    def for_rank(self, rank: int, world_size: int, ranks_per_node: int | None = None) -> Any:
        """A copy of this dataset (same manifest, seed, plan) that reads as ``rank`` of
        ``world_size`` (``ranks_per_node`` on each node: unknown, a partition per rank)."""
        Place(rank, world_size)
        per_node = (
            detect_ranks_per_node(rank, world_size, ranks_per_node) if ranks_per_node else None
        )
        clone = copy.copy(self)
        clone._world = World(rank, world_size, ranks_per_node, self.partition_mode)
        clone._control = Control(
            [self.epoch, 0, rank, world_size, per_node or 0, 0, *encode_history(())]
        )
        return clone

    def refresh_world(self) -> None:
        """Re-detect rank/world and ranks per node (call after ``init_process_group``;
        make_loader does); a position counted in other partitions is re-planned.  A place
        taken from a data-parallel group stays as it was read."""
        if self._world is not None:
            self.set_world(self._world)
        else:
            self._settle()

    # -- the pass this process walks: its state_dict (NOTE [worker states]) ------------------
    def _begin_pass(self, place: Place) -> tuple[_Pass, Place, int, int]:
        """Record the pass this process starts as ``place``: ``(pass, place read as, epoch,
        start)``, where ``start`` skips the steps a loaded worker state had handed out, and
        the place is the worker whose steps this one reads (NOTE [worker states])."""
        epoch, start, history = self._where()
        pending, self._pending = self._pending, None
        done = rotation = 0
        if pending is not None:
            if pending.partitions != self.partition.nodes:
                raise ResumeError(
                    f"this worker's state was saved in {pending.partitions} partition(s), "
                    f"the job now has {self.partition.nodes}: StatefulDataLoader resumes in "
                    "the layout it saved in (make_loader's state resumes in any)"
                )
            if pending.epoch == epoch:
                start, history, done = pending.start, pending.reshapes, pending.done
                rotation = pending.rotation
            else:
                rotation = self._rotation_after(pending)
        virtual = (place.worker - rotation) % place.num_workers
        plan = self._plan(epoch, start, place.rank, place.world_size, history)
        steps = len(plan.slots.worker_steps(virtual, place.num_workers))
        progress = _Pass(
            epoch, start, history, self.partition.nodes, place, steps, min(done, steps), rotation
        )
        progress.batches = plan.num_batches
        self._progress = progress
        skip = start + progress.done * place.num_workers * place.world_size
        read_as = Place(place.rank, place.world_size, virtual, place.num_workers)
        return progress, read_as, epoch, skip

    def _rotation_after(self, saved: _Pass) -> int:
        """The worker the loader takes the first batch of the next pass from, after the
        finished pass ``saved``: StatefulDataLoader goes on round robin from the worker after
        the last one it took from (a state of a pass part-way through cannot be dropped)."""
        was = saved.place
        plan = self._plan(saved.epoch, saved.start, was.rank, was.world_size, saved.reshapes)
        virtual = (was.worker - saved.rotation) % was.num_workers
        own = len(plan.slots.worker_steps(virtual, was.num_workers))
        if saved.done < own:
            raise ResumeError(
                f"this worker's state is part-way through epoch {saved.epoch} ({saved.done} of "
                f"its {own} steps handed out) and the pass is of epoch {self.epoch}: call "
                f"set_epoch({saved.epoch}) to finish that epoch first"
            )
        return (saved.rotation + plan.slots.steps_per_rank) % was.num_workers

    def state_dict(self) -> dict[str, Any]:
        """Where this process stands: in the main process the loader's state (where every
        rank stands); in a DataLoader worker that worker's own share (NOTE [worker states])."""
        from torch.utils.data import get_worker_info

        progress, info = self._progress, get_worker_info()
        if progress is None:
            return make_state(self, *self._where(), self.partition.nodes)
        place = progress.place
        if info is None:
            position = progress.start + progress.done * place.world_size
            if progress.done >= progress.steps and progress.partitions == 1:
                position = min(position, progress.batches)  # the end, at any world size
        else:
            position = progress.start
        state = make_state(self, progress.epoch, position, progress.reshapes, progress.partitions)
        if info is None:
            return state
        state["worker"] = {
            "id": place.worker,
            "workers": place.num_workers,
            "rank": place.rank,
            "world_size": place.world_size,
            "steps": progress.done,
            "rotation": progress.rotation,
        }
        return state

    def load_state_dict(self, state: Any) -> None:
        """Continue from :meth:`state_dict`'s dict: in the main process like the loader's
        ``load_state_dict`` (any world size and ``num_workers``), in a worker its own share,
        for the next pass of the state's epoch (NOTE [worker states])."""
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker = state.get("worker") if isinstance(state, Mapping) else None
        if info is None:
            if worker is not None:
                raise ResumeError(
                    "this state is one DataLoader worker's (StatefulDataLoader hands it back "
                    "to that worker): load the loader's state, not a worker's"
                )
            resume(self, state)
            self._progress = None
            return
        if not isinstance(worker, Mapping):
            raise ResumeError(
                f"DataLoader worker {info.id} got a state without its 'worker' entry: a "
                "worker resumes from the state StatefulDataLoader saved in it"
            )
        epoch, position, reshapes, partitions = read_state(self, state)
        if partitions is None or state.get("mixture") != self.extra_state().get("mixture"):
            raise ResumeError(
                "a DataLoader worker resumes with the batch shape and mixture weights it saved "
                "with; to change them, resume through make_loader"
            )
        try:
            keys = ("rank", "world_size", "id", "workers", "steps", "rotation")
            rank, world, wid, workers, done, rotation = (int(worker[k]) for k in keys)
        except (KeyError, TypeError, ValueError) as err:
            raise ResumeError(f"saved worker entry {dict(worker)!r} is malformed") from err
        control = self._control.get()
        if (wid, workers, rank, world) != (info.id, info.num_workers, *control[_RANK : _WORLD + 1]):
            raise ResumeError(
                f"the saved state is rank {rank} of {world}, worker {wid} of {workers}; this "
                f"is rank {control[_RANK]} of {control[_WORLD]}, worker {info.id} of "
                f"{info.num_workers}: StatefulDataLoader resumes at the world size and "
                "num_workers it saved at (make_loader's state resumes at any)"
            )
        place = Place(rank, world, wid, workers)
        self._pending = _Pass(epoch, position, reshapes, partitions, place, 0, done, rotation)

    def extra_state(self) -> dict[str, Any]:
        """What the state adds to the position: its source's (a mixture: its weights)."""
        return self._source.extra_state(self)  # type: ignore[no-any-return]

    def load_extra_state(self, state: Mapping[str, Any], epoch: int, position: int) -> None:
        """Replay what :meth:`extra_state` saved, in a state resumed at ``epoch``, ``position``."""
        self._source.load_extra_state(self, state, epoch, position)


def _history(reshapes: Sequence[Reshape]) -> dict[int, int]:
    """The control block's values that hold the epoch's reshape history ``reshapes``."""
    return dict(enumerate(encode_history(reshapes), _HISTORY))


def integer(name: str, value: Any) -> int:
    """``int(value)`` as before, but a value that is no integer is a UsageError naming it."""
    try:
        return int(value)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{name} must be an integer, got {value!r}") from err
