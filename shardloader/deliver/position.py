"""Where a dataset stands: epoch, resume position, rank, world and its partitions.

NOTE [why shared memory here] in :mod:`shardloader.deliver.control`: these few integers live in
shared memory, so persistent DataLoader workers see a ``set_epoch`` / ``seek`` / resume made in the
main process.  :class:`DatasetPosition` is the part of
:class:`~shardloader.dataset.ShardedDataset` that owns them; a position counted in other
partitions than the current ones (a resume, a world that changed) becomes a link of the epoch's
history here (NOTE [reshape history] in :mod:`shardloader.plan.elastic`), so every planning path
sees one consistent ``(epoch, position, reshapes)``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

from shardloader.deliver.control import Control
from shardloader.errors import UsageError
from shardloader.options import World
from shardloader.plan.elastic import Reshape, encode_history, history_of, shape_of
from shardloader.plan.partition import Partition, choose_partition
from shardloader.plan.split import Place
from shardloader.world import detect_ranks_per_node, detect_world, resolve_world

__all__ = ["DatasetPosition", "integer"]

# the shared control block: epoch, position, rank, world size, ranks per node (0: unknown), and
# the partitions the position was counted in (0: the current ones)
_EPOCH, _START, _RANK, _WORLD, _PER_NODE, _START_NODES = range(6)


class DatasetPosition:
    """Epoch, position, world and partitions of a dataset, shared with its workers."""

    partition_mode: str
    manifest: Any
    _planning: Any
    _progress: Any = None  # the pass this process walks (shardloader.deliver.stateful)

    def _init_position(self, world: World) -> None:
        self._control = Control([0, 0, 0, 1, 0, 0])
        self._reshapes = Control(encode_history(()))  # NOTE [reshape history] (plan/elastic.py)
        self.set_world(world, settle=False)

    def set_world(self, world: World, *, settle: bool = True) -> None:
        """Read from now on where ``world`` says (a :class:`~shardloader.options.World`:
        detected, a rank of a world size, or this rank's replica of a data-parallel group); a
        position counted in other partitions is re-planned."""
        self.partition_mode = world.partition
        self._explicit_world = (world.rank, world.world_size)
        self._explicit_per_node = world.ranks_per_node
        self._fixed_place = world.group is not None  # read once, from the group
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

    def _partition_of(self, world: int, per_node: int | None) -> Partition:
        return choose_partition(self.partition_mode, world, per_node, self.manifest.num_samples)

    @property
    def position(self) -> int:
        """Global batches of the current epoch the next pass skips (its resume point)."""
        return self._where()[1]

    def resume_point(self) -> tuple[int, int]:
        """``(epoch, position)`` read together: where the next pass starts."""
        epoch, position, _ = self._where()
        return epoch, position

    def _where(self) -> tuple[int, int, tuple[Reshape, ...]]:
        """``(epoch, position, reshapes)`` of the next pass in the current partitions: a
        position counted in other partitions (a resume, or a world that changed) becomes a
        link of the epoch's history, and the rest is planned afresh (NOTE [reshape history]
        in :mod:`shardloader.plan.elastic`)."""
        values = self._control.get()
        epoch, start, counted = values[_EPOCH], values[_START], values[_START_NODES]
        history = history_of(self._reshapes.get())
        nodes = self._partition_of(values[_WORLD], values[_PER_NODE] or None).nodes
        if start and counted and counted != nodes:
            shape = shape_of(self._planning) or 0
            history += ((shape, start) if counted == 1 else (shape, counted, start),)
            start = 0
        return epoch, start, history

    def _settle(self) -> None:
        """Write :meth:`_where` back, counted in the current partitions."""
        epoch, start, history = self._where()
        self._set_reshapes(history)
        self._control.update({_START: start, _START_NODES: self.partition.nodes})

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (reshuffles); keeps a loaded resume position for that same epoch."""
        epoch = integer("epoch", epoch)
        if epoch != self.epoch:
            # the last pass's progress (deliver/stateful.py) no longer applies
            self._progress = None
            self._control.update({_START: 0, _START_NODES: 0})
            self._set_reshapes(())
        self._control.set(_EPOCH, epoch)

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
        self._set_reshapes(reshapes)
        self._progress = None
        nodes = 0 if partitions is None else integer("partitions", partitions)
        self._control.update({_EPOCH: epoch, _START: position, _START_NODES: nodes})

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

    def _set_reshapes(self, reshapes: Sequence[Reshape]) -> None:
        self._reshapes.update(dict(enumerate(encode_history(reshapes))))

    def for_rank(self, rank: int, world_size: int, ranks_per_node: int | None = None) -> Any:
        """A copy of this dataset (same manifest, seed, plan) that reads as ``rank`` of
        ``world_size`` (``ranks_per_node`` on each node: unknown, a partition per rank)."""
        Place(rank, world_size)
        per_node = (
            detect_ranks_per_node(rank, world_size, ranks_per_node) if ranks_per_node else None
        )
        clone = copy.copy(self)
        clone._explicit_world = (rank, world_size)
        clone._explicit_per_node = ranks_per_node
        clone._fixed_place = False
        clone._control = Control([self.epoch, 0, rank, world_size, per_node or 0, 0])
        clone._reshapes = Control(encode_history(()))
        return clone

    def refresh_world(self) -> None:
        """Re-detect rank/world and ranks per node (call after ``init_process_group``;
        make_loader does); a position counted in other partitions is re-planned.  A place
        taken from a data-parallel group stays as it was read."""
        if self._fixed_place:
            self._settle()
            return
        r, w = detect_world(*self._explicit_world)
        per_node = detect_ranks_per_node(r, w, self._explicit_per_node)
        self._control.update({_RANK: r, _WORLD: w, _PER_NODE: per_node or 0})
        self._settle()


def integer(name: str, value: Any) -> int:
    """``int(value)`` as before, but a value that is no integer is a UsageError naming it."""
    try:
        return int(value)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{name} must be an integer, got {value!r}") from err
