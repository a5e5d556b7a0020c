"""``--executor ray``: the planned shard writes as Ray tasks on a cluster.

The driver (the process that called ``pack``) lists and plans exactly as a local pack does, so
the shards, their numbers and their bytes are the same; each task runs
:func:`~shardloader.pack.write.write_and_place` on a cluster node, which reads its inputs,
writes the shard and moves it to its final name under OUT itself (OUT must be reachable from
every node: an object store URL, or a shared filesystem).  The driver writes the sidecars it
gets back and the manifest, last.  Ray is imported only here, when asked for
(``pip install 'shardloader[ray]'``).

NOTE [ray tasks]: what a task carries is a ``WriteSpec`` and a ``ShardTask``: stores (URL,
options, retry policy), file references and line runs by position, never record bytes, so a
task is small however big its shard.  Storage options travel to the cluster with each task:
credentials in them reach the nodes (prefer the nodes' own credentials, e.g. instance roles).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from shardloader.errors import UsageError

__all__ = ["RayExecutor"]

log = logging.getLogger(__name__)


_ABORT_WAIT_S = 30.0  # how long abort() waits for cancelled tasks to stop


class RayExecutor:
    """Runs each submitted call as one Ray task (one CPU each).

    ``address``: the cluster (``ray.init(address=...)``); None: ``RAY_ADDRESS``, else a local
    Ray that lives as long as this executor.  A Ray already initialised in this process (a
    notebook, a test) is used as it is and left running.  ``in_flight`` tasks at most are
    submitted at once (``--workers``; 1, the default: the cluster's CPUs plus one), which
    bounds what the driver holds.
    """

    remote = True

    def __init__(self, address: str | None, in_flight: int) -> None:
        try:
            import ray
        except ImportError as err:
            raise UsageError("--executor ray needs Ray: pip install 'shardloader[ray]'") from err
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            try:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
            except ConnectionError as err:
                raise UsageError(f"--executor ray: cannot reach the Ray cluster ({err})") from err
            self._started = True
        elif address is not None:
            log.warning("Ray is already initialised in this process; --address %s unused", address)
        if in_flight <= 1:  # --workers left at 1: keep every CPU of the cluster busy, and one more
            in_flight = int(ray.cluster_resources().get("CPU", 1)) + 1
        self.in_flight = in_flight
        self._remote: dict[Callable[..., Any], Any] = {}
        self._refs: list[Any] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        task = self._remote.get(fn)
        if task is None:
            task = self._remote[fn] = self._ray.remote(num_cpus=1, max_retries=0)(fn)
        ref = task.remote(*args)
        self._refs.append(ref)
        fut: Future[Any] = Future()
        ref.future().add_done_callback(partial(_unwrap, fut, self._ray))
        return fut

    def abort(self) -> None:
        """Cancel every task still running and wait until they have stopped, so the caller's
        removal of temporary files comes after the last write (a cancelled task may be
        mid-shard; one that cannot be reached within the wait leaves its
        ``.<name>.tmp-<run id>`` for the next run to delete, like a killed worker's)."""
        refs, self._refs = self._refs, []
        for ref in refs:
            try:
                self._ray.cancel(ref, force=True)
            except Exception as err:  # a finished task or a lost node: nothing left to stop
                log.debug("ray.cancel: %s", err)
        if refs:
            try:
                self._ray.wait(refs, num_returns=len(refs), timeout=_ABORT_WAIT_S)
            except Exception as err:  # a lost cluster: nothing more to wait for
                log.debug("ray.wait after cancel: %s", err)

    def shutdown(self) -> None:
        self._refs.clear()
        if self._started:
            self._ray.shutdown()
            self._started = False


def _unwrap(fut: Future[Any], ray: Any, done: Future[Any]) -> None:
    """Hand over a task's result, or the exception the task raised (not Ray's wrapper, whose
    message is a remote traceback): the CLI prints a ShardloaderError as one line."""
    try:
        fut.set_result(done.result())
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        fut.set_exception(cause if isinstance(cause, BaseException) else err)
    except BaseException as err:  # a lost node, a cancelled task: Ray's own error
        fut.set_exception(err)
