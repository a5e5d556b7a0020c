"""CPU time (user + system) of a whole process tree: the benchmarks' figure that other jobs on
the machine barely move.

Wall-clock throughput on a shared machine moves with the load; the CPU a run costs does not
(much).  Every benchmark in ``tools/`` prints, beside throughput, the CPU time per sample (or
per MB) of everything the run involves: the measuring process, its DataLoader workers, pack
workers and servers.

How it counts, exactly once each: a process's own ``utime + stime``, plus ``cutime + cstime``
(what its children and their reaped descendants used once they were waited for), plus the same
for each of its children still alive (or not yet reaped), read from ``/proc``.  So a worker that
exited and was joined is in its parent's ``cutime``; one still running is read directly.
:class:`TreeCPU` takes that figure at start and at stop; :func:`tree_cpu` reads it once.
"""

from __future__ import annotations

import os

__all__ = ["TreeCPU", "cpu_line", "per_unit", "tree_cpu"]

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(ppid, own CPU seconds, reaped children's CPU seconds) of ``pid``, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # after the name: state ppid ... utime(14) stime(15) cutime(16) cstime(17), 1-based
    ppid = int(fields[1])
    own = (int(fields[11]) + int(fields[12])) / _TICK
    reaped = (int(fields[13]) + int(fields[14])) / _TICK
    return ppid, own, reaped


def tree_cpu(pid: int | None = None) -> float:
    """CPU seconds so far of ``pid`` (default: this process) and every descendant, alive or
    reaped (see the module's docstring)."""
    root = os.getpid() if pid is None else pid
    stats: dict[int, tuple[int, float, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            got = _stat(int(name))
            if got is not None:
                stats[int(name)] = got
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(p)
    total, todo = 0.0, [root]
    if root == os.getpid():  # exact for this process, threads included
        t = os.times()
        total, todo = (
            t.user + t.system + t.children_user + t.children_system,
            children.get(root, []),
        )
    while todo:
        p = todo.pop()
        got = stats.get(p)
        if got is None:
            continue
        total += got[1] + got[2]
        todo.extend(children.get(p, []))
    return total


class TreeCPU:
    """CPU seconds of a process tree between :meth:`start` and :meth:`stop` (a context manager
    too); ``pids`` adds other trees, e.g. servers the benchmark started beforehand."""

    def __init__(self, pid: int | None = None, pids: tuple[int, ...] = ()) -> None:
        self.roots = (pid, *pids)
        self._start = 0.0
        self.seconds = 0.0

    def _now(self) -> float:
        return sum(tree_cpu(p) for p in self.roots)

    def start(self) -> TreeCPU:
        self._start = self._now()
        return self

    def stop(self) -> float:
        self.seconds = self._now() - self._start
        return self.seconds

    def __enter__(self) -> TreeCPU:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def per_unit(seconds: float, units: float, scale: float = 1e6) -> float:
    """CPU per unit (µs per sample by default; ``scale=1e3`` for ms)."""
    return seconds / units * scale if units else float("nan")


def cpu_line(seconds: float, units: float, unit: str = "sample") -> str:
    """``CPU 12.3 µs/sample (process tree, load 1.9)``: the line a benchmark prints."""
    return (
        f"CPU {per_unit(seconds, units):.1f} µs/{unit} (whole process tree, user + sys; "
        f"load {os.getloadavg()[0]:.1f})"
    )


def subreaper() -> bool:
    """Become the reaper of orphaned descendants (pack's forkserver, litdata's workers), so
    their CPU time reaches this process's RUSAGE_CHILDREN.  Linux only: False elsewhere."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_orphans(deadline: float) -> None:
    """Wait, until ``deadline`` (monotonic), for descendants a run left behind (re-parented to
    this process by :func:`subreaper`)."""
    import time

    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.02)
