"""``monitor(loader)``: is the training loop waiting for data?  Measured live, per batch.

The wrapper times each ``next()`` on the loader (the *data wait*) and the time from handing a
batch out to being asked for the next one (the *step*: forward, backward, optimizer, logging).
The data-bound share is ``wait / (wait + step)``, read as the DataLoader article in
``shared/seed`` reads it:

* above 20 %: **data-bound**: the pipeline cannot keep up; raise ``num_workers``, keep workers
  persistent, check the storage (``shardloader bench`` finds the knee);
* below 5 %: **compute-bound**: the data keeps up; a larger batch or mixed precision pays;
* in between: **balanced**, often heavy CPU augmentation or decoding.

The first batch's wait (worker start-up, shard staging) is reported on its own as
``first_batch_s`` and left out of the shares, which describe the steady state.

Every ``interval`` batches, and at the end of each pass, it reports the window since the last
report as one line, to stderr by default, so a monitor put in the loop is visible without
configuring logging (an epoch shorter than ``interval`` still gets its line)::

    shardloader.monitor: batch 400: waiting for data 12.3% (3.1 ms/batch), 210.4 batches/s, balanced

This line is the library's one deliberate output channel (everything else goes through
``logging``): ``report="log"`` sends it to the ``shardloader.deliver.monitor`` logger at INFO
instead, ``report=a_logger`` or ``report=a_stream`` elsewhere, and ``report=None`` switches it
off (``callback=`` still gets every report).

Disabled (``enabled=False``), ``monitor`` returns the loader's own iterator: the loop runs at
exactly the speed it would without it.  Enabled, the cost is two ``perf_counter`` calls and a
few additions per batch (``tools/bench_monitor.py`` measures it); reports cost a formatted line
once per ``interval``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Generic, Literal, TypeVar, overload

from shardloader.errors import UsageError

__all__ = [
    "Report",
    "all_ranks",
    "DATA_BOUND_ABOVE",
    "COMPUTE_BOUND_BELOW",
    "Monitor",
    "MonitorStats",
    "monitor",
    "verdict",
]

log = logging.getLogger(__name__)

DATA_BOUND_ABOVE = 0.20  # the article's reading: more than 20 % of the time waiting for data
COMPUTE_BOUND_BELOW = 0.05  # less than 5 %: the model is the bottleneck

_ADVICE = {
    "data-bound": "the loader cannot keep up: raise num_workers, keep workers persistent, "
    "check the storage (shardloader bench finds the knee)",
    "compute-bound": "the data keeps up: a larger batch or mixed precision would pay",
    "balanced": "some waiting: often heavy CPU augmentation or decoding; lighter transforms "
    "or a faster decoder would help",
    "no data yet": "no steady-state batch measured yet",
}

T = TypeVar("T")

# Where the periodic report line goes: "stderr" (the default), "log" (INFO on this module's
# logger), a logging.Logger, a text stream, or None (no line; callback= still runs).
Report = Literal["stderr", "log"] | logging.Logger | IO[str] | None

_clock = time.perf_counter  # module attribute so tests can drive a fake clock


def verdict(data_share: float) -> str:
    """The article's reading of a data-bound share: data-bound, balanced or compute-bound."""
    if data_share > DATA_BOUND_ABOVE:
        return "data-bound"
    if data_share < COMPUTE_BOUND_BELOW:
        return "compute-bound"
    return "balanced"


@dataclass(frozen=True)
class MonitorStats:
    """A snapshot of the timings; ``data_share + step_share == 1`` exactly.

    ``batches`` counts every batch handed out; the shares cover ``timed_batches`` of them
    (all but the first, whose wait is ``first_batch_s``).
    """

    batches: int
    timed_batches: int
    data_wait_s: float  # waiting in next(), first batch excluded
    step_s: float  # between handing out a batch and being asked for the next
    first_batch_s: float | None

    @property
    def data_share(self) -> float:
        total = self.data_wait_s + self.step_s
        return self.data_wait_s / total if total > 0 else 0.0

    @property
    def step_share(self) -> float:
        # NOTE: 1 - a is within half an ulp of the exact value, so a + (1 - a) rounds to
        # exactly 1.0 for every a in [0, 1]: the shares add up by construction.
        return 1.0 - self.data_share

    @property
    def verdict(self) -> str:
        return verdict(self.data_share) if self.data_wait_s + self.step_s > 0 else "no data yet"

    @property
    def advice(self) -> str:
        return _ADVICE[self.verdict]

    def since(self, earlier: MonitorStats) -> MonitorStats:
        """The stats of the batches after ``earlier`` (a window between two reports)."""
        return MonitorStats(
            batches=self.batches - earlier.batches,
            timed_batches=self.timed_batches - earlier.timed_batches,
            data_wait_s=self.data_wait_s - earlier.data_wait_s,
            step_s=self.step_s - earlier.step_s,
            first_batch_s=None if earlier.first_batch_s is not None else self.first_batch_s,
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers and strings for the user's logger (wandb, TensorBoard, a CSV...)."""
        shares = {"data_share": self.data_share, "step_share": self.step_share}
        return {**dataclasses.asdict(self), **shares, "verdict": self.verdict}

    def summary(self) -> str:
        """One line: ``data-bound share 31.2% (data-bound) over 99 batches ...``."""
        first = f", first batch {self.first_batch_s:.2f}s" if self.first_batch_s is not None else ""
        return (
            f"data-bound share {self.data_share:.1%} ({self.verdict}) over {self.timed_batches} "
            f"batches: waiting {self.data_wait_s:.2f}s, stepping {self.step_s:.2f}s{first}"
        )

    def report_line(self, batch: int) -> str:
        """The periodic report of this window, ending at ``batch`` (1-based)::

        batch 400: waiting for data 12.3% (3.1 ms/batch), 210.4 batches/s, balanced
        """
        timed = max(self.timed_batches, 1)
        total = self.data_wait_s + self.step_s
        rate = f"{self.timed_batches / total:,.1f} batches/s" if total > 0 else "- batches/s"
        first = f", first batch {self.first_batch_s:.2f}s" if self.first_batch_s is not None else ""
        return (
            f"batch {batch}: waiting for data {self.data_share:.1%} "
            f"({self.data_wait_s / timed * 1e3:.1f} ms/batch), {rate}, {self.verdict}{first}"
        )


_EMPTY = MonitorStats(0, 0, 0.0, 0.0, None)


class Monitor(Generic[T]):
    """Iterable wrapper around a loader that accumulates data-wait and step times.

    Iterate it like the loader (again each epoch: totals accumulate across passes);
    :meth:`stats` gives a snapshot at any time.  Every ``interval`` batches (and when a pass
    ends) it writes a line
    about the window since the last report to ``report`` (see :data:`Report`) and calls
    ``callback`` with ``{**window.as_dict(), "total": totals.as_dict()}``.  ``logger=L`` is
    kept as a shorthand for ``report=L``.
    """

    def __init__(
        self,
        loader: Iterable[T],
        *,
        interval: int = 100,
        report: Report = "stderr",
        logger: logging.Logger | None = None,
        callback: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
            raise UsageError(f"interval must be a whole number of batches >= 0, got {interval!r}")
        if logger is not None and report is not None:
            report = logger
        if report == "log":
            report = log
        if not (
            report is None
            or report == "stderr"
            or isinstance(report, logging.Logger)
            or callable(getattr(report, "write", None))
        ):
            raise UsageError(
                f"report must be 'stderr', 'log', a logging.Logger, a text stream "
                f"or None, got {report!r}"
            )
        self.loader = loader
        self.interval = interval
        self.report = report
        self.callback = callback
        self._timed = 0
        self._wait = 0.0
        self._step = 0.0
        self._first: float | None = None
        self._reported = _EMPTY

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        return self._timed_pass()

    def stats(self) -> MonitorStats:
        """Totals so far (all passes)."""
        first = self._first
        batches = self._timed + (first is not None)
        return MonitorStats(batches, self._timed, self._wait, self._step, first)

    def _timed_pass(self) -> Iterator[T]:
        # NOTE: the hot loop is kept to two clock reads, three additions and a countdown
        # per batch (and a test of the first batch); tools/bench_monitor.py measures it.
        clock = _clock
        interval = self.interval
        # batches until the next report (one every ``interval`` batches handed out in all);
        # below 0 it counts down forever: no reports
        left = interval - self.stats().batches % interval if interval else -1
        asked = clock()
        for batch in iter(self.loader):  # starts a non-persistent DataLoader's workers: data time
            handed = clock()
            if self._first is None:
                self._first = handed - asked
            else:  # a later pass: its first wait is steady-state data time
                self._wait += handed - asked
                self._timed += 1
            left -= 1
            if not left:
                left = interval
                self._report()
            yield batch
            asked = clock()
            self._step += asked - handed
        if interval:  # the pass is over: what it did since the last line, even in a short epoch
            self._report()

    def _report(self) -> None:
        total = self.stats()
        window = total.since(self._reported)
        if not window.timed_batches:
            return  # only a first batch so far: nothing steady to report
        self._reported = total
        report = self.report
        if isinstance(report, logging.Logger):
            if report.isEnabledFor(logging.INFO):
                report.info("%s%s", _prefix(), window.report_line(total.batches))
        elif report is not None:
            # NOTE: the library's one print: an explicit, documented channel (report=None
            # switches it off); sys.stderr is looked up now, so redirections apply.
            stream = sys.stderr if report == "stderr" else report
            try:
                stream.write(f"{_prefix()}{window.report_line(total.batches)}\n")
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream must not stop training
                pass
        if self.callback is not None:
            self.callback({**window.as_dict(), "total": total.as_dict()})


def _prefix() -> str:
    """``shardloader.monitor:``, with the rank under an initialised torch.distributed job."""
    dist = sys.modules.get("torch.distributed")  # never imports torch itself
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            if world > 1:
                return f"shardloader.monitor [rank {dist.get_rank()}/{world}]: "
    except (RuntimeError, ValueError):
        pass
    return "shardloader.monitor: "


@overload
def monitor(
    loader: Iterable[T],
    *,
    interval: int = ...,
    report: Report = ...,
    logger: logging.Logger | None = ...,
    callback: Callable[[dict[str, Any]], None] | None = ...,
    enabled: Literal[True] = ...,
) -> Monitor[T]: ...


@overload
def monitor(
    loader: Iterable[T],
    *,
    interval: int = ...,
    report: Report = ...,
    logger: logging.Logger | None = ...,
    callback: Callable[[dict[str, Any]], None] | None = ...,
    enabled: bool,
) -> Monitor[T] | Iterator[T]: ...


def monitor(
    loader: Iterable[T],
    *,
    interval: int = 100,
    report: Report = "stderr",
    logger: logging.Logger | None = None,
    callback: Callable[[dict[str, Any]], None] | None = None,
    enabled: bool = True,
) -> Monitor[T] | Iterator[T]:
    """Wrap ``loader`` to measure how much of the loop waits for data.

    ``for batch in shardloader.monitor(loader): ...``; keep the returned object to read
    ``.stats()`` (a :class:`MonitorStats`).  ``interval``: batches between reports (0: none).
    ``report``: where each report's line goes: ``"stderr"`` (default), ``"log"`` (INFO on
    ``shardloader.deliver.monitor``), a ``logging.Logger``, a text stream, or ``None`` (off).
    ``enabled=False`` returns ``iter(loader)`` itself, so leaving the call in costs nothing.
    """
    if not enabled:
        return iter(loader)
    return Monitor(loader, interval=interval, report=report, logger=logger, callback=callback)


def all_ranks(stats: MonitorStats) -> MonitorStats:
    """The stats summed over every rank of the initialised process group (the whole job's
    share of time spent waiting); the stats unchanged outside ``torch.distributed``."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stats
    totals = torch.tensor(
        [stats.data_wait_s, stats.step_s, stats.timed_batches, stats.batches], dtype=torch.float64
    )
    dist.all_reduce(totals)
    first = torch.tensor([stats.first_batch_s or 0.0], dtype=torch.float64)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    return MonitorStats(
        int(totals[3]), int(totals[2]), float(totals[0]), float(totals[1]), float(first[0])
    )
