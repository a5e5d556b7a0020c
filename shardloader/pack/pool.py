"""Where shards are written: inline (``--workers 1``) or in a pool of light worker processes."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_all_start_methods, get_context
from multiprocessing.context import BaseContext
from typing import Any

from shardloader.pack.write import ShardResult, worker_init

__all__ = ["Executor", "Inline", "Pool", "PRELOAD"]

PRELOAD = "shardloader.pack._preload"  # what the forkserver imports once (never torch)


class Inline:
    """``--workers 1``: write in this process, same code path as the pool."""

    def submit(self, fn: Callable[..., ShardResult], *args: Any) -> Future[ShardResult]:
        fut: Future[ShardResult] = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as err:  # re-raised by fut.result(), like the pool does
            fut.set_exception(err)
        return fut

    def abort(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _mp_context() -> BaseContext:
    """Workers start from a *forkserver* that has imported the writer once.

    Not ``fork``: the main process may have imported torch and started threads.  Not plain
    ``spawn``: every worker would import shardloader (and torch with it) again, seconds each.
    The server is a fresh single-threaded process that has imported nothing but the writer.
    """
    if "forkserver" not in get_all_start_methods():
        return get_context("spawn")
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    return ctx


class Pool:
    """A process pool of shard writers."""

    def __init__(self, workers: int) -> None:
        self._ex = ProcessPoolExecutor(
            workers, mp_context=_mp_context(), initializer=worker_init, initargs=(os.getpid(),)
        )

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._ex.submit(fn, *args)

    def abort(self) -> None:
        """Stop now: cancel queued shards, terminate workers mid-shard, wait for them."""
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
        self._ex.shutdown(wait=True)


Executor = Inline | Pool
