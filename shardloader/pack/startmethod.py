"""How local pack workers start (:class:`~shardloader.pack.pool.Pool`): forked from this
process when that is safe, else from a forkserver that imported only the writer.

This module imports nothing of shardloader.
"""

from __future__ import annotations

import sys
import threading
from multiprocessing import get_all_start_methods, get_context
from multiprocessing.context import BaseContext

__all__ = ["PRELOAD", "context"]

PRELOAD = "shardloader.pack._preload"  # what the forkserver imports once (never torch)


def context() -> BaseContext:
    """How pack workers start: ``fork`` when that is safe, else the forkserver.

    NOTE [worker start]: forking this process is the cheapest start (nothing is imported
    again: half a second less than the forkserver on a busy machine) and safe while it runs no
    other Python thread and has not imported torch (whose thread pools do not survive a
    fork): the CLI's case, and a script's that only packs.  Anywhere else (a notebook that
    trained, a process with threads) workers start from the forkserver, which imports only the
    writer (:mod:`._preload`: no torch, no storage stacks).  Either way a worker resets the
    signal handlers it inherited (:func:`~shardloader.pack.write.worker_init`).
    """
    if (
        "fork" in get_all_start_methods()
        and "torch" not in sys.modules
        and threading.active_count() == 1
        and threading.current_thread() is threading.main_thread()
    ):
        return get_context("fork")
    # The forkserver: a fresh single-threaded process that imported the writer once.  Not
    # plain spawn: every worker would import shardloader (and torch with it) again, seconds each.
    # (Every platform pack runs on has one: the OUT lock needs POSIX flock, pack/lock.py.)
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    return ctx
