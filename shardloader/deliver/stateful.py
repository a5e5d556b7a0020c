"""The dataset's own ``state_dict`` / ``load_state_dict``: what torchdata's
``StatefulDataLoader`` saves and restores, in each DataLoader worker.

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
    A worker writes nothing of the dataset's shared control block (NOTE [why shared memory
    here] in :mod:`shardloader.deliver.control`): what it loads stays in its own copy, for its next
    pass of that epoch; a pass of another epoch drops it (as ``set_epoch`` to another epoch
    drops a loaded position).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardloader.deliver.loaderstate import make_state, read_state, resume
from shardloader.deliver.position import _RANK, _WORLD, DatasetPosition
from shardloader.errors import ResumeError
from shardloader.plan.elastic import Reshape
from shardloader.plan.split import Place

__all__ = ["DatasetState"]


@dataclass
class _Pass:
    """The pass a process is walking, and how many of its own steps it handed out."""

    epoch: int
    start: int  # global batches before the pass, counted in ``partitions``
    reshapes: tuple[Reshape, ...]
    partitions: int
    rank: int
    world_size: int
    worker: int
    workers: int
    steps: int  # this process's steps of the pass
    done: int = 0
    rotation: int = 0  # worker w reads the steps of worker w - rotation (NOTE [worker states])
    batches: int = 0  # the partition's batches in the pass's plan


class DatasetState(DatasetPosition):
    """``state_dict`` / ``load_state_dict`` of a dataset, per process (NOTE [worker states])."""

    _progress: _Pass | None = None
    _pending: _Pass | None = None  # a worker's loaded state, for its next pass
    _plan: Any  # ShardedDataset's: the plan of a pass

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
            epoch,
            start,
            history,
            self.partition.nodes,
            place.rank,
            place.world_size,
            place.worker,
            place.num_workers,
            steps,
            min(done, steps),
            rotation,
            plan.num_batches,
        )
        self._progress = progress
        skip = start + progress.done * place.num_workers * place.world_size
        read_as = Place(place.rank, place.world_size, virtual, place.num_workers)
        return progress, read_as, epoch, skip

    def _rotation_after(self, saved: _Pass) -> int:
        """The worker the loader takes the first batch of the next pass from, after the
        finished pass ``saved``: StatefulDataLoader goes on round robin from the worker after
        the last one it took from (a state of a pass part-way through cannot be dropped)."""
        plan = self._plan(saved.epoch, saved.start, saved.rank, saved.world_size, saved.reshapes)
        virtual = (saved.worker - saved.rotation) % saved.workers
        own = len(plan.slots.worker_steps(virtual, saved.workers))
        if saved.done < own:
            raise ResumeError(
                f"this worker's state is part-way through epoch {saved.epoch} ({saved.done} of "
                f"its {own} steps handed out) and the pass is of epoch {self.epoch}: call "
                f"set_epoch({saved.epoch}) to finish that epoch first"
            )
        return (saved.rotation + plan.slots.steps_per_rank) % saved.workers

    def state_dict(self) -> dict[str, Any]:
        """Where this process stands: in the main process the loader's state (where every
        rank stands); in a DataLoader worker that worker's own share (NOTE [worker states])."""
        from torch.utils.data import get_worker_info

        progress, info = self._progress, get_worker_info()
        if progress is None:
            epoch, position, reshapes = self._where()
            return make_state(self, epoch, position, reshapes, self.partition.nodes)
        if info is None:
            position = progress.start + progress.done * progress.world_size
            if progress.done >= progress.steps and progress.partitions == 1:
                position = min(position, progress.batches)  # the end, at any world size
        else:
            position = progress.start
        state = make_state(self, progress.epoch, position, progress.reshapes, progress.partitions)
        if info is None:
            return state
        state["worker"] = {
            "id": progress.worker,
            "workers": progress.workers,
            "rank": progress.rank,
            "world_size": progress.world_size,
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
        epoch, position, reshapes, partitions = read_state(self, state, load_extra=False)
        extra = getattr(self, "extra_state", None)
        if partitions is None or (extra is not None and state.get("mixture") != extra()["mixture"]):
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
        self._pending = _Pass(
            epoch, position, reshapes, partitions, rank, world, wid, workers, 0, done, rotation
        )
