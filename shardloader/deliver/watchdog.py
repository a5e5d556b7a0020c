"""A hang watchdog: a pass that produces nothing for ``ReadOptions.stall_timeout`` seconds is
named and ended with a :class:`~shardloader.errors.StallError` instead of hanging the job.

NOTE [stall watchdog]
    Only the time a pass spends *asked* for its next item counts: from the moment the
    consumer (a DataLoader worker's fetch, or the training loop without workers) resumes the
    pass generator until it yields.  A pass suspended between batches (a full prefetch queue,
    a slow training step) is never stalled.  A daemon thread per pass watches that clock.
    Past the timeout it writes the report: rank, worker, the step of the pass, the shard and
    sample the stuck thread is on (read from the stack's own frames: the innermost frame of
    :mod:`shardloader.read.loading` that holds a sample ``key``, else the step's shards), and
    the stuck thread's Python stack as :mod:`faulthandler` dumps it (which works whatever the
    thread holds).  The report is logged at once, then the stuck thread is interrupted:

    - in a process's main thread (every DataLoader worker; a loop without workers, usually)
      by a real-time signal whose handler, installed for the pass and restored after it,
      raises; a blocking ``sleep``, ``wait`` or read is interrupted by the signal too;
    - in another thread by an asynchronous exception, raised when it next runs Python.

    What is raised is a private ``BaseException``, so no ``except Exception`` on the way (a
    transform's own, or ``on_error="skip"``) swallows it; the pass turns it into the
    :class:`~shardloader.errors.StallError`, which a worker hands to the main process as any
    error.  A thread stuck in C code that blocks the signal or retries its call after it cannot
    be interrupted: a DataLoader worker then writes the report to stderr and to a file of this
    user's named after the main process and the worker, and exits after ``stall_timeout`` more
    seconds; when torch says the worker exited, the loader raises the StallError from that
    file (:func:`worker_stalled`).  A loop without workers keeps the logged report.
"""

from __future__ import annotations

import ctypes
import faulthandler
import glob
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

from shardloader.errors import StallError

__all__ = ["watched", "worker_stalled"]

log = logging.getLogger(__name__)

_SIGNAL = getattr(signal, "SIGRTMIN", None)  # a real-time signal nobody else sends
if _SIGNAL is not None:
    _SIGNAL += 5


class _Stalled(BaseException):
    """Raised into the stuck thread; the pass turns it into a StallError."""


def watched(items: Iterator[Any], seconds: float | None, place: Any) -> Iterator[Any]:
    """``items`` (a pass), watched for stalls of ``seconds`` (NOTE [stall watchdog]); as it is
    when ``seconds`` is None."""
    if seconds is None:
        return items
    return _watch(items, _Watchdog(float(seconds), place))


def _watch(items: Iterator[Any], dog: _Watchdog) -> Iterator[Any]:
    dog.start()
    try:
        while True:
            dog.since = time.monotonic()
            try:
                item = next(items)
            except StopIteration:
                return
            except _Stalled:
                raise StallError(dog.report or "the pass stalled") from None
            finally:
                dog.since = None
                dog.steps += 1
            yield item
    finally:
        dog.stop()
        close = getattr(items, "close", None)
        if close is not None:
            close()


class _Watchdog:
    """The clock and the watching thread of one pass."""

    def __init__(self, seconds: float, place: Any) -> None:
        self.seconds, self.place = seconds, place
        self.since: float | None = None  # when the pass was last resumed, None when it rests
        self.steps = 0  # items yielded so far
        self.report: str | None = None
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.current_thread()
        self._main = self._thread is threading.main_thread()
        self._old_handler: Any = None
        self._watcher = threading.Thread(
            target=self._watch, name="shardloader-watchdog", daemon=True
        )

    def start(self) -> None:
        if self._main and _SIGNAL is not None:
            self._old_handler = signal.signal(_SIGNAL, self._interrupted)
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not threading.current_thread():
            self._watcher.join()
        if (
            self._old_handler is not None
            and _SIGNAL is not None
            and threading.current_thread() is threading.main_thread()
        ):
            signal.signal(_SIGNAL, self._old_handler)

    # -- in the watching thread -------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(min(self.seconds / 4, 1.0)):
            since = self.since
            if since is None or time.monotonic() - since < self.seconds:
                continue
            self.report = self._describe()
            log.error("%s", self.report)
            self.fired = True
            self._interrupt()
            if self._stop.wait(self.seconds):
                return
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            if info is not None:  # the thread did not come back: do not hang the job
                sys.stderr.write(f"{self.report}\n(the stuck worker exits)\n")
                sys.stderr.flush()
                _leave_report(self.report, info.id)
                os._exit(70)
            return

    def _interrupt(self) -> None:
        ident = self._thread.ident
        if ident is None:
            return
        if self._main and _SIGNAL is not None:
            signal.pthread_kill(ident, _SIGNAL)
        else:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(ident), ctypes.py_object(_Stalled)
            )

    def _interrupted(self, signum: int, frame: FrameType | None) -> None:
        if self.fired and self.since is not None:
            raise _Stalled

    def _describe(self) -> str:
        frames = sys._current_frames()
        frame = frames.get(self._thread.ident or -1)
        where = _where(frame) if frame is not None else None
        stack = _stack(self._thread.ident or -1)
        return (
            f"{self.place}: the pass produced nothing for {self.seconds:g} s "
            f"(ReadOptions.stall_timeout) at step {self.steps} of this worker's pass"
            f"{', ' + where if where else ''}; the stuck thread's stack (most recent call "
            f"first):\n{stack}\nA transform, decoder or collate that waits forever (a lock, a "
            "network call without a timeout) is the usual cause: give it a timeout, or raise "
            "stall_timeout if a step may legitimately take this long"
        )


def _where(frame: FrameType) -> str | None:
    """The shard and sample a stuck pass is on, from its own frames (innermost first)."""
    step = None
    f: FrameType | None = frame
    while f is not None:
        names = f.f_locals
        shards = names.get("shards")
        if "key" in names and "ids" in names and "pos" in names and shards is not None:
            try:  # SampleLoader.build_sample: one sample
                shard = int(shards.locate(names["ids"][names["pos"] : names["pos"] + 1])[0][0])
                return f"in {shards.describe(shard)}, sample {names['key']!r}"
            except Exception:  # noqa: BLE001 - a report; the stack below says the rest
                return f"in sample {names['key']!r}"
        if step is None and shards is not None and "ids" in names:
            try:  # the pass's loop: the step's samples
                located = shards.locate(names["ids"])[0]
                parts = sorted({int(s) for s in located})
                step = "in " + "; ".join(shards.describe(s) for s in parts[:4])
            except Exception:  # noqa: BLE001
                step = None
        f = f.f_back
    return step


def _stack(ident: int) -> str:
    """The Python stack of thread ``ident`` as faulthandler dumps it (all threads are
    dumped; the stuck one's part is kept)."""
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.seek(0)
        text = out.read()
    marker = f"0x{ident:016x}"
    mine = [b for b in text.split("\n\n") if marker in b.strip().split("\n", 1)[0]]
    return (mine[0] if mine else text).strip()


def _leave_report(report: str, worker: int) -> None:
    """Leave the report of DataLoader worker ``worker`` where the main process looks when torch
    says the worker exited (:func:`worker_stalled`): a file of this user's only, never one that
    was there."""
    name = f"shardloader-stall-{os.getppid()}-{worker}.txt"
    path = os.path.join(tempfile.gettempdir(), name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(report)
    except OSError:
        pass  # the report is on stderr and in the log already


def worker_stalled(err: BaseException) -> StallError | None:
    """The :class:`StallError` of a DataLoader worker that the watchdog could not interrupt
    and that exited (torch raises "worker ... exited unexpectedly"), from the report it left;
    None for any other error."""
    if not isinstance(err, RuntimeError) or "exited unexpectedly" not in str(err):
        return None
    reports = []
    names = f"shardloader-stall-{os.getpid()}-*"  # what _leave_report writes
    for path in sorted(glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), names))):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, encoding="utf-8") as f:
                mine = os.fstat(f.fileno()).st_uid == os.getuid()
                text = f.read()
            os.unlink(path)
        except OSError:
            continue
        if mine:
            reports.append(text)
    if not reports:
        return None
    return StallError(
        f"{reports[0]}\n(the stuck thread could not be interrupted, so the worker exited: {err})"
    )
