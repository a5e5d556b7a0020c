"""Where shards are written: one interface, three executors.

- :class:`Inline` (``--workers 1``): in this process.
- :class:`Pool` (``--workers N``): a pool of light local worker processes.
- ``RayExecutor`` (``--executor ray``, :mod:`.ray_executor`): Ray tasks on a cluster; Ray is
  imported only then.

An executor runs ``fn(*args)`` somewhere and hands back a ``concurrent.futures.Future``; the
orchestrator (:mod:`.run`) keeps a bounded number in flight, collects results in plan order and
writes sidecars and the manifest itself.  ``remote`` says whether a task runs where the
orchestrator cannot see its files: then the task moves its shard into place itself
(:func:`~shardloader.pack.write.write_and_place`) instead of handing back a temporary path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from shardloader.pack.startmethod import context
from shardloader.pack.write import worker_init

if TYPE_CHECKING:
    from shardloader.pack.options import PackOptions

__all__ = ["Executor", "make_executor"]


class Executor(Protocol):
    """What the orchestrator needs of a place to run shard writes."""

    remote: bool  # tasks run on other machines: they place their shards themselves
    in_flight: int  # how many tasks the orchestrator keeps submitted (bounds memory)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]: ...

    def abort(self) -> None:
        """Stop now: cancel what has not started, stop what runs; safe to call twice."""

    def shutdown(self) -> None:
        """Release the workers (after every future has been collected, or after abort)."""


class Inline:
    """``--workers 1``: write in this process, same code path as the pool."""

    remote = False
    in_flight = 1  # finish each shard at once: a finished shard never waits for the next one

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as err:  # re-raised by fut.result(), like the pool does
            fut.set_exception(err)
        return fut

    def abort(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class Pool:
    """A process pool of shard writers, started at once in the background.

    Starting a worker waits for the forkserver to import the writer (half a second on a busy
    machine); a thread asks for every worker right away, so that happens while the caller
    lists and plans the input, not after the first shard is planned.
    """

    remote = False

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.in_flight = workers + 1
        ctx = context()
        self._ex = ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=worker_init, initargs=(os.getpid(),)
        )
        self._aborted = False
        if ctx.get_start_method() == "fork":  # the first submit forks every worker, at once
            self._ex.submit(os.getpid)
            self._warm = threading.Thread(target=lambda: None)
        else:
            self._warm = threading.Thread(target=self._start, name="shardloader-pack-start")
        self._warm.start()

    def _start(self) -> None:
        try:
            for fut in [self._ex.submit(os.getpid) for _ in range(self.workers)]:
                fut.exception()  # wait: the workers are up (or the pool is already broken)
        except RuntimeError:  # shut down meanwhile (an early usage error)
            pass

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._ex.submit(fn, *args)

    def abort(self) -> None:
        """Stop now: cancel queued shards, terminate workers mid-shard, wait for them."""
        if self._aborted:
            return
        self._aborted = True
        self._warm.join()
        procs = list((getattr(self._ex, "_processes", None) or {}).values())
        manager = getattr(self._ex, "_executor_manager_thread", None)
        self._ex.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
        if manager is not None:
            manager.join(10)  # it notices the dead workers and exits

    def shutdown(self) -> None:
        self._warm.join()
        self._ex.shutdown(wait=True)


def make_executor(options: PackOptions) -> Executor:
    """The executor ``options`` ask for (``executor``, ``workers``, ``address``)."""
    if options.executor == "ray":
        from shardloader.pack.ray_executor import RayExecutor

        return RayExecutor(options.address, options.workers)
    return Inline() if options.workers == 1 else Pool(options.workers)
