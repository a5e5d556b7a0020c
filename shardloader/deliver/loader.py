"""``make_loader``: a plain torch DataLoader that also saves and restores its position.

NOTE [resume position]: a rank's ``j``-th batch is global batch ``start + j*W + rank``, and all
ranks step in lockstep, so after ``k`` batches the first ``start + k*W`` global batches are
consumed on every rank.  That single number (with epoch, seed and the manifest fingerprint) is
the whole state; a resumed loader plans the remaining batches for *its* world size and worker
count and seeks straight to them, reading nothing it skips.

NOTE [epoch boundaries]: a batch counts as consumed once it is handed to the loop.  When the
last step of epoch ``e``'s pass has been handed out, the pass is over and ``state_dict()`` says
``{"epoch": e + 1, "position": 0}``, whether it is taken inside the loop right after that step
or after the loop has ended.  So a run resumed from it continues with epoch ``e + 1`` and yields
nothing more of ``e``, and the usual loop needs no special case::

    loader.load_state_dict(state)
    for epoch in range(state["epoch"], num_epochs):
        ds.set_epoch(epoch)          # keeps the loaded position for that same epoch
        for batch in loader: ...

NOTE [planned steps]: every pass is planned before it starts (``len(loader)`` steps), and all of
them must arrive.  torch's DataLoader can lose batches without an error: a worker whose batch
cannot be pickled or its tensors shared logs a traceback from its queue thread, drops the batch
and carries on, so the pass ends early (or waits forever, when more steps remain than were
requested ahead).  The loader therefore counts the steps and raises
:class:`~shardloader.errors.IncompleteEpochError` when a pass ends short, and checks before
starting workers that they can share tensors at all.  A loop that stops early (``break``) is not
an error.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from shardloader.dataset import ShardedDataset
from shardloader.deliver.loaderstate import make_state, resume
from shardloader.deliver.transport import Ring, batch_bytes, unbundle, worker_bundle
from shardloader.deliver.watchdog import worker_stalled
from shardloader.deliver.workers import WorkerInit, check_workers_pickle
from shardloader.errors import IncompleteEpochError, UsageError

__all__ = ["ShardLoader", "make_loader"]

log = logging.getLogger(__name__)


class ShardLoader(DataLoader):  # type: ignore[type-arg]
    """A ``torch.utils.data.DataLoader`` over a :class:`ShardedDataset` with resumable state."""

    def __init__(self, dataset: ShardedDataset, **kwargs: Any) -> None:
        if not isinstance(dataset, ShardedDataset):
            raise UsageError("ShardLoader needs a ShardedDataset")
        for banned in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if banned in kwargs:
                raise UsageError(
                    f"{banned}= belongs to ShardedDataset (batches are formed in the workers), "
                    "not to the loader"
                )
        if kwargs.get("num_workers", 0) > 0:
            kwargs.setdefault("persistent_workers", True)
            bundle = worker_bundle(dataset)  # NOTE [bundles] in shardloader/deliver/transport.py
            kwargs.setdefault("prefetch_factor", 2 if bundle > 1 else 4)
            ring, size = None, batch_bytes(dataset)
            if bundle > 1 and size:  # raw bundles cross pickled
                # NOTE [ring slots]: in flight, held by the loop, one spare
                ring = Ring(
                    kwargs["num_workers"], kwargs["prefetch_factor"] + 3, bundle * size * 5 // 4
                )
            elif bundle == 1:  # image batches of one shape: stacked into slots (slotcollate.py)
                from shardloader.deliver.slotcollate import image_ring

                ring = image_ring(dataset, kwargs["num_workers"], kwargs["prefetch_factor"])
            check_workers_pickle(  # NOTE [worker start methods] in deliver/workers.py
                dataset,
                kwargs.get("multiprocessing_context"),
                collate_fn=kwargs.get("collate_fn"),
                worker_init_fn=kwargs.get("worker_init_fn"),
            )
            # NOTE [orphaned workers] in shardloader/deliver/workers.py: each worker watches us
            kwargs["worker_init_fn"] = WorkerInit(bundle, ring, kwargs.get("worker_init_fn"))
        kwargs.setdefault("collate_fn", _already_collated)
        super().__init__(dataset, batch_size=None, **kwargs)
        self._position = 0  # global batches consumed in the current epoch
        self._epoch = dataset.epoch
        self._partitions: int | None = None  # what the position was counted in (None: as now)
        self._steps_left: int | None = None  # steps of the current pass not yet handed out
        self._sockets_checked = False
        self._running = False  # a pass is under way (load_state_dict would not reach it)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        ds.refresh_world()  # a position counted in other partitions is re-planned here
        (epoch, start), world = ds.resume_point(), ds.world_size
        self._partitions = ds.partition.nodes
        planned = len(ds)
        if self.num_workers > 0 and not self._sockets_checked:
            _check_worker_sockets()
            self._sockets_checked = True
        self._epoch, self._position, self._steps_left = epoch, start, planned
        seen = 0
        source = self._in_process() if self._direct else super().__iter__()
        self._running = True
        try:
            for item in source:
                for batch in unbundle(item):  # a worker's bundle holds consecutive steps
                    seen += 1
                    self._position += world
                    self._steps_left = planned - seen
                    yield batch
            if seen < planned:
                self._short_pass(ds, epoch, seen, planned)
        except GeneratorExit:
            raise  # left early: persistent workers wait for the next pass, others end with it
        except BaseException as err:
            self._end_workers(source)
            stalled = worker_stalled(err)  # NOTE [stall watchdog] in deliver/watchdog.py
            if stalled is not None:
                raise stalled from err
            raise
        finally:
            self._running = False
        if ds.epoch == epoch:
            ds.seek(epoch, 0)  # the epoch is done; a re-run starts it afresh

    def _end_workers(self, source: Iterator[Any]) -> None:
        """End the workers of a pass that failed now, persistent or not; the next pass starts
        new ones (NOTE [workers of a failed pass]).

        NOTE [workers of a failed pass]: the error's traceback holds torch's iterator in a
        reference cycle, so the garbage collector would shut its workers down, in whatever
        thread it happens to run, and only after it has run the index queues' finalizers,
        which stop their feeding threads: the "exit" message never reaches the workers, and
        the shutdown waits 5 s for each before it kills it (measured: 5.2 s for one worker).
        """
        shutdown = getattr(source, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        if self._iterator is source:  # persistent workers: the next pass must not reuse them
            self._iterator = None

    @property
    def _direct(self) -> bool:
        """No workers, no pinning, no timeout: :meth:`_in_process` gives what torch's
        single-process iterator would."""
        return self.num_workers == 0 and not self.pin_memory and not self.timeout

    def _in_process(self) -> Iterator[Any]:
        """The dataset's batches through ``collate_fn``, as torch's single-process iterator
        hands them over, without its per-batch bookkeeping (a profiler range, a sampler and a
        fetcher: 12 µs a batch, a fifth of a token batch's whole cost).  Like torch, it draws
        one number from the loader's generator (or torch's) per pass, so seeded runs keep
        their random streams."""
        import torch

        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        collate = self.collate_fn
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        for item in ds:
            yield item if collate is _already_collated else collate(item)

    def _short_pass(self, ds: ShardedDataset, epoch: int, seen: int, planned: int) -> None:
        where = f"epoch {epoch}, rank {ds.rank}/{ds.world_size}, num_workers={self.num_workers}"
        if ds.batch_size is None and ds.planner is None and ds.on_error == "skip" and seen:
            # unbatched, a skipped sample is a skipped step: nothing can replace it
            log.warning(
                "%d of %d planned samples arrived (%s); on_error='skip' skipped the rest",
                seen,
                planned,
                where,
            )
            return
        self._steps_left = None  # the pass did not finish: the state must not move past it
        raise IncompleteEpochError(
            f"the loader yielded {seen} of the {planned} planned steps ({where}): batches were "
            "lost between the DataLoader workers and this loop. Look for worker tracebacks on "
            "stderr: a batch that cannot be pickled (an unpicklable object in the collate's "
            "output), tensors that cannot be shared ('AF_UNIX path too long': set TMPDIR to a "
            "short path), or workers killed by the system"
        )

    def state_dict(self) -> dict[str, Any]:
        """A few numbers: enough to continue exactly where every rank stands now, the same on
        every rank (NOTE [one state for every rank] in :mod:`shardloader.deliver.loaderstate`)."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        epoch, position = self._epoch, self._position
        reshapes = ds.reshapes if epoch == ds.epoch else ()
        if self._steps_left == 0:  # the pass is over: continue with the next epoch
            epoch, position, reshapes = epoch + 1, 0, ()
        return make_state(ds, epoch, position, reshapes, self._partitions or ds.partition.nodes)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run; world size and num_workers may differ from the saving run, and
        so may the batch shape (``batch_size``, or the planner's ``elastic`` option, e.g.
        ``rows_per_batch``): the rest of the epoch is then re-cut for the new shape, sample by
        sample (token by token for packed batches; NOTE [reshape history] in
        :mod:`shardloader.plan.elastic`).  Load before iterating: a pass under way goes on from
        where it is, so loading then is an error."""
        if self._running:
            raise UsageError(
                "load_state_dict() while a pass is under way: the running iterator would go "
                "on from where it is; load the state before iterating (then `for batch in "
                "loader` continues from it)"
            )
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        resume(ds, state)
        self._epoch, self._position = ds.epoch, ds.position
        self._partitions = None
        self._steps_left = None


def _check_worker_sockets() -> None:
    """Fail at start, with the remedy, when workers could not share a batch's tensors.

    Under torch's default ``file_descriptor`` sharing a worker passes each tensor's file
    descriptor through an AF_UNIX socket under TMPDIR; a path beyond the kernel's limit
    (107 bytes) makes every batch vanish in the worker's queue thread.
    """
    import torch.multiprocessing

    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    address = multiprocessing.connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(address)
    except OSError as err:
        raise UsageError(
            f"DataLoader workers cannot hand batches to this process: torch shares their "
            f"tensors through an AF_UNIX socket such as {address} ({len(os.fsencode(address))} "
            f"bytes), and binding it failed ({err}); a socket path may hold at most 107 bytes, "
            f"so TMPDIR={tempfile.gettempdir()} is probably too deep: set TMPDIR to a short "
            "path (e.g. /tmp), or call torch.multiprocessing.set_sharing_strategy('file_system')"
        ) from err
    finally:
        sock.close()
    if os.path.exists(address):
        os.unlink(address)


def _already_collated(batch: Any) -> Any:
    """Batches are collated in the workers; torch's per-item ``default_convert`` is skipped."""
    return batch


def make_loader(
    dataset: ShardedDataset, *, data_parallel: Any = None, **kwargs: Any
) -> ShardLoader:
    """A configured DataLoader: workers persist across epochs, batches come formed.

    ``data_parallel`` (deprecated, goes in the next release): the job's data-parallel group;
    pass ``world=shardloader.World.of(group)`` to the dataset instead.
    """
    if data_parallel is not None:
        dataset.set_data_parallel(data_parallel)  # warns, naming the replacement
    return ShardLoader(dataset, **kwargs)
