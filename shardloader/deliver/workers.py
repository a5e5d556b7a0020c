"""How :class:`~shardloader.deliver.loader.ShardLoader` workers start, a check at
``make_loader`` that they can, and what every worker does first: watch its parent, take the
loader's transport (NOTE [bundles] in :mod:`shardloader.deliver.transport`), run the user's
``worker_init_fn``.

NOTE [worker start methods]
    ``make_loader`` leaves the start method to torch and Python: ``fork`` on Linux up to
    Python 3.13, ``forkserver`` from 3.14, ``spawn`` on macOS and Windows, or the loader's
    ``multiprocessing_context``.  Every method yields the same batches (the dataset's shared
    state and the loader's ring travel by file descriptor to a worker that does not inherit
    them: NOTE [why shared memory here] in :mod:`shardloader.deliver.position`,
    :class:`~shardloader.deliver.transport.Ring`).  A forked worker inherits the dataset; any
    other gets it pickled, so a transform, collate or planner that cannot pickle (a lambda, a
    function defined inside another) fails only there, in torch's worker start, with a message
    that names no field.  :func:`check_workers_pickle` pickles the dataset and the loader's
    functions once at construction and names the one that fails.

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

import multiprocessing
import os
import pickle
import threading
import time
from typing import Any

from shardloader.errors import UsageError

__all__ = ["CHECK_SECONDS", "WorkerInit", "check_workers_pickle", "start_method", "watch_parent"]

CHECK_SECONDS = 1.0
_EXIT_CODE = 1  # what a worker whose parent died ends with

_watching: int | None = None  # the process id the watch was started in


def start_method(context: Any) -> str:
    """The start method of workers made with this ``multiprocessing_context`` (None: the
    process's default, without fixing it)."""
    if isinstance(context, str):
        return context
    if context is not None:
        return str(context.get_start_method())
    chosen = multiprocessing.get_start_method(allow_none=True)
    return chosen or multiprocessing.get_all_start_methods()[0]


def check_workers_pickle(dataset: Any, context: Any, **functions: Any) -> None:
    """Raise a UsageError naming what cannot be pickled, when workers start by a method other
    than ``fork`` (NOTE [worker start methods]); ``functions``: the loader's own
    (``collate_fn``, ``worker_init_fn``) by name."""
    method = start_method(context)
    if method == "fork":
        return
    parts = [(f"the dataset's {k}", v) for k, v in dataset.__getstate__().items()]
    parts += [(f"the loader's {k}", v) for k, v in functions.items() if v is not None]
    for name, value in parts:
        try:
            pickle.dumps(value)
        except Exception as err:
            raise UsageError(
                f"DataLoader workers start by {method!r} here (the default from Python 3.14 "
                f"on Linux), so each gets the dataset pickled, and {name} ({value!r:.80}) "
                f"cannot be pickled ({type(err).__name__}: {err}): define it at module level "
                "(a lambda or a function defined inside another never pickles), or pass "
                "multiprocessing_context='fork' where fork is safe (Linux, no threads or CUDA "
                "in this process)"
            ) from err
    pickle.dumps(dataset)  # the dataset as a whole: let its own error through


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
    the dataset the bundle size and the loader's :class:`~shardloader.deliver.transport.Ring`
    (when its workers send bundles), then calls the user's function (if any)."""

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
