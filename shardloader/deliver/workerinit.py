"""What every :class:`~shardloader.deliver.loader.ShardLoader` worker does first: watch its parent,
take the loader's transport (NOTE [bundles] in :mod:`shardloader.deliver.transport`), run the user's
``worker_init_fn``.

NOTE [orphaned workers]: torch's worker loop notices a dead parent only between batches (its
``ManagerWatchdog``, every 5 s), and then still joins the thread that feeds its result queue.
That queue is one pipe shared by every worker; each worker inherited its read end, so when the
training process is SIGKILLed the pipe never breaks.  Batches that carry bytes (raw samples,
``RawBatch``) fill its 64 KiB at once, the feeding threads block in ``write`` (one of them
holding the queue's shared lock, the others waiting for it), and the workers never exit: they
keep their memory, shard locks and staged files for good.  So each worker runs one daemon
thread that compares ``os.getppid()`` with the parent it started under, every
:data:`CHECK_SECONDS`, and ends the process with ``os._exit`` once the parent is gone (a
reparented process has another parent id: init or a subreaper).  Nothing is lost that a SIGKILL
of the worker would keep: staging writes to temporary names and shard locks die with the
process.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

__all__ = ["CHECK_SECONDS", "WorkerInit", "watch_parent"]

CHECK_SECONDS = 1.0
_EXIT_CODE = 1  # what a worker whose parent died ends with

_watching: int | None = None  # the process id the watch was started in


def watch_parent(seconds: float = CHECK_SECONDS) -> None:
    """Start (once per process) the thread that ends this process when its parent dies
    (NOTE [orphaned workers])."""
    global _watching
    pid = os.getpid()
    if _watching == pid:  # a forked child inherits the flag, never the thread
        return
    _watching = pid
    parent = os.getppid()
    threading.Thread(
        target=_watch, args=(parent, seconds), name="shardloader-parent-watch", daemon=True
    ).start()


def _watch(parent: int, seconds: float) -> None:
    while os.getppid() == parent:
        time.sleep(seconds)
    os._exit(_EXIT_CODE)


class WorkerInit:
    """The ``worker_init_fn`` of a ShardLoader: watches the parent, gives the worker's copy of
    the dataset the bundle size and the loader's :class:`~shardloader.deliver.transport.Ring` (when
    its workers send bundles), then calls the user's function (if any)."""

    def __init__(self, bundle: int = 1, ring: Any = None, user: Any = None) -> None:
        self.bundle, self.ring, self.user = bundle, ring, user

    def __call__(self, worker_id: int) -> None:
        from torch.utils.data import get_worker_info

        watch_parent()
        info = get_worker_info()
        if info is not None and (self.bundle > 1 or self.ring is not None):
            info.dataset.use_transport(self.bundle, self.ring)  # type: ignore[attr-defined]
        if self.user is not None:
            self.user(worker_id)
