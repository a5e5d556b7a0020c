"""Find the loader settings past which more workers stop helping: sweep, measure, recommend.

The method is the DataLoader article's (``shared/seed``), automated: for each ``num_workers``
(and ``prefetch_factor``), with and without decoding and transforms, read a fixed number of
batches after the first and record batches/s, samples/s, MB/s, the time to the first batch and
the memory of the whole process tree (main process plus workers).  :func:`knee` finds where
the throughput curve flattens and :func:`recommend` turns the curves into settings with a
one-line reason.  Both are pure functions of the measurements, so they are tested on made-up
curves.

Measured with the OS page cache warm (a first unrecorded pass stages the shards): a dataset
larger than memory, read cold, can be slower in training than here.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from shardloader.codecs import Decoder
from shardloader.collate import collate_samples
from shardloader.dataset import ShardedDataset
from shardloader.errors import UsageError
from shardloader.loader import make_loader
from shardloader.shards import ReadOptions

__all__ = [
    "BenchResult",
    "Recommendation",
    "default_workers",
    "format_table",
    "knee",
    "measure",
    "plot",
    "recommend",
    "sweep",
]

DEFAULT_TOLERANCE = 0.10  # within 10 % of the best throughput counts as "as fast"
_DECODE_BOUND_RATIO = 1.5  # reading alone this much faster than decoding: decode-bound
_MB = 1e6


# -- measurements ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchResult:
    """One point of a sweep."""

    num_workers: int
    prefetch_factor: int | None  # None with num_workers=0
    decode: bool  # fields decoded and transforms run (False: raw bytes)
    batches: int  # timed batches (the first one is timed apart)
    samples: int
    seconds: float
    first_batch_s: float  # iter() to the first batch: worker start-up included
    mb: float  # uncompressed shard megabytes behind the timed samples
    peak_rss_mb: float  # sampled sum of RSS over the process tree (shared pages per process)
    pss_mb: float | None = None  # proportional set size of the tree at the end (Linux)

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.mb / self.seconds if self.seconds > 0 else 0.0

    @property
    def memory_mb(self) -> float:
        """The memory figure to compare points by: PSS when known, else peak RSS."""
        return self.pss_mb if self.pss_mb is not None else self.peak_rss_mb

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(batches_per_s=self.batches_per_s, samples_per_s=self.samples_per_s,
                   mb_per_s=self.mb_per_s)
        return out


def require_psutil() -> Any:
    """psutil (it lists a process's children everywhere); a clear error when missing."""
    try:
        import psutil
    except ImportError as err:
        raise UsageError(
            "measuring the memory of the process tree needs psutil: pip install psutil"
        ) from err
    return psutil


class _TreeMemory:
    """Samples the summed RSS of this process and all its descendants in a daemon thread.

    Listing descendants scans /proc (milliseconds), so the list is refreshed every
    ``refresh_s``; the RSS of known processes is read every ``interval_s`` (microseconds).
    """

    def __init__(self, interval_s: float = 0.02, refresh_s: float = 0.25) -> None:
        psutil = require_psutil()

        self._psutil = psutil
        self._root = psutil.Process()
        self._interval, self._refresh = interval_s, refresh_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardloader-bench-mem",
                                        daemon=True)
        self.peak = 0

    def _tree(self) -> list[Any]:
        try:
            return [self._root, *self._root.children(recursive=True)]
        except self._psutil.Error:
            return [self._root]

    def sample(self, procs: Iterable[Any]) -> int:
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except self._psutil.Error:  # a worker that just exited
                pass
        self.peak = max(self.peak, total)
        return total

    def _run(self) -> None:
        procs, listed = self._tree(), time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - listed > self._refresh:
                procs, listed = self._tree(), time.monotonic()
            self.sample(procs)
            self._stop.wait(self._interval)

    def __enter__(self) -> _TreeMemory:
        self.sample([self._root])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sample(self._tree())
        self._stop.set()
        self._thread.join()

    def pss(self) -> int | None:
        """Proportional set size of the tree now (shared pages split between sharers)."""
        total = 0
        for p in self._tree():
            try:
                with open(f"/proc/{p.pid}/smaps_rollup", "rb") as f:
                    for line in f:
                        if line.startswith(b"Pss:"):
                            total += int(line.split()[1]) * 1024
                            break
            except FileNotFoundError:
                if p.pid == self._root.pid:
                    return None  # no smaps_rollup here (not Linux >= 4.14)
            except (OSError, ValueError):
                pass
        return total


def _count(batch: Any, default: int) -> int:
    if isinstance(batch, Mapping) and "__index__" in batch:
        return len(batch["__index__"])
    return default


def measure(
    dataset: ShardedDataset,
    num_workers: int,
    prefetch_factor: int | None,
    batches: int,
    *,
    decode: bool = True,
    memory_interval_s: float = 0.02,
) -> BenchResult:
    """Time ``batches`` batches after the first through :func:`make_loader` (epochs wrap)."""
    if batches < 1:
        raise UsageError(f"batches must be >= 1, got {batches}")
    if num_workers < 0:
        raise UsageError(f"num_workers must be >= 0, got {num_workers}")
    options: dict[str, Any] = {"num_workers": num_workers}
    if num_workers > 0:
        if prefetch_factor is None or prefetch_factor < 1:
            raise UsageError(f"prefetch_factor must be >= 1 with workers, got {prefetch_factor}")
        options.update(prefetch_factor=prefetch_factor, persistent_workers=True)
    else:
        prefetch_factor = None
    manifest = dataset.manifest
    mb_per_sample = sum(s.raw_bytes for s in manifest.shards) / manifest.num_samples / _MB
    per_batch = dataset.batch_size or 1
    epoch = dataset.epoch
    loader = make_loader(dataset, **options)
    clock = time.perf_counter
    it = None
    try:
        with _TreeMemory(memory_interval_s) as memory:
            started = clock()
            it = iter(loader)
            _count(next(it), per_batch)
            first = clock() - started
            got = samples = 0
            timed_from = clock()
            while got < batches:
                try:
                    batch = next(it)
                except StopIteration:
                    epoch += 1
                    dataset.set_epoch(epoch)
                    it = iter(loader)
                    continue
                got += 1
                samples += _count(batch, per_batch)
            seconds = clock() - timed_from
            pss = memory.pss()
    finally:
        del it, loader  # shuts the workers down before the next point starts
        gc.collect()
    return BenchResult(
        num_workers=num_workers,
        prefetch_factor=prefetch_factor,
        decode=decode,
        batches=got,
        samples=samples,
        seconds=seconds,
        first_batch_s=first,
        mb=samples * mb_per_sample,
        peak_rss_mb=memory.peak / _MB,
        pss_mb=None if pss is None else pss / _MB,
    )


def default_workers(cpu_count: int | None = None) -> tuple[int, ...]:
    """0, 1, 2, 4, 8, ... up to the core count, and the core count itself."""
    cores = cpu_count or os.cpu_count() or 1
    out, w = [0, 1], 2
    while w < cores:
        out.append(w)
        w *= 2
    if cores > 1:
        out.append(cores)
    return tuple(out)


def sweep(
    url: str,
    *,
    workers: Sequence[int] | None = None,
    prefetch: Sequence[int] = (2, 4),
    batch_size: int | None = 32,
    shuffle: bool = False,
    seed: int = 0,
    batches: int = 50,
    decode: Sequence[bool] = (True, False),
    transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    decoder: Decoder | None = None,
    read: ReadOptions | None = None,
    warmup: bool = True,
    progress: Callable[[BenchResult], None] | None = None,
) -> list[BenchResult]:
    """Measure every (decode, num_workers, prefetch_factor) point on the dataset at ``url``.

    ``decode=True`` decodes with ``decoder`` (default ``Decoder()``) and runs ``transform``;
    ``decode=False`` reads raw bytes (no decoding, no ``transform``): comparing the two tells
    reading from decoding.  Fields of unequal shapes are collated as lists, so a dataset of
    images of many sizes can be measured without a transform (one tensor per image then
    crosses from the worker: a resizing transform, as in training, is cheaper to move).
    Each point reads the same first batches of epoch 0 (in stored order, or shuffled by
    ``seed``); ``warmup`` reads them once, unrecorded, so staging shards is not charged to the
    first point.
    """
    require_psutil()
    workers = tuple(default_workers() if workers is None else workers)
    if not workers or not decode:
        raise UsageError("give at least one num_workers value and one decode mode")
    if any(w > 0 for w in workers) and not prefetch:
        raise UsageError("give at least one prefetch_factor value for num_workers > 0")
    collate = functools.partial(collate_samples, ragged="list")

    def dataset(decoded: bool) -> ShardedDataset:
        return ShardedDataset(
            url, batch_size=batch_size, shuffle=shuffle, seed=seed, collate_fn=collate, read=read,
            decoder=(decoder or Decoder()) if decoded else None,
            transform=transform if decoded else None,
        )

    if warmup:
        measure(dataset(False), 0, None, batches, decode=False)
    results = []
    for decoded in decode:
        for w in workers:
            for p in prefetch if w > 0 else (None,):
                result = measure(dataset(decoded), w, p, batches, decode=decoded)
                results.append(result)
                if progress is not None:
                    progress(result)
    return results


# -- the knee and the recommendation (pure) -------------------------------------------------


def knee(throughput: Sequence[float], tolerance: float = DEFAULT_TOLERANCE) -> int:
    """Index of the first point within ``tolerance`` of the best throughput.

    Points are in increasing ``num_workers``; from the knee on, more workers buy less than
    ``tolerance`` (the curve has flattened, or falls).  A rising curve's knee is its last point.
    """
    if not throughput:
        raise UsageError("no measurements to find a knee in")
    if not 0 <= tolerance < 1:
        raise UsageError(f"tolerance must be in [0, 1), got {tolerance}")
    best = max(throughput)
    return next(i for i, y in enumerate(throughput) if y >= (1 - tolerance) * best)


@dataclass(frozen=True)
class Recommendation:
    """Settings for ``make_loader`` and why, in one line."""

    num_workers: int
    prefetch_factor: int | None
    reason: str
    decode: bool  # the curve it was read from (decoded, when measured)
    samples_per_s: float
    memory_mb: float
    knee: int  # num_workers at the knee (more than num_workers when memory capped it)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        pf = "" if self.prefetch_factor is None else f", prefetch_factor={self.prefetch_factor}"
        return f"recommended: num_workers={self.num_workers}{pf}: {self.reason}"


def _best_per_workers(results: Sequence[BenchResult], decode: bool) -> list[BenchResult]:
    """The fastest point (over prefetch factors) for each num_workers, by num_workers."""
    best: dict[int, BenchResult] = {}
    for r in results:
        if r.decode == decode and (
            r.num_workers not in best or r.samples_per_s > best[r.num_workers].samples_per_s
        ):
            best[r.num_workers] = r
    return [best[w] for w in sorted(best)]


def _bound(
    results: Sequence[BenchResult], decode: bool, workers: int, cpu_count: int | None
) -> str:
    """Why the curve flattens: decoding (CPU) or reading, when both modes were measured."""
    if decode:
        dec = {r.num_workers: r for r in _best_per_workers(results, True)}.get(workers)
        raw = {r.num_workers: r for r in _best_per_workers(results, False)}.get(workers)
        if dec is not None and raw is not None and dec.samples_per_s > 0:
            ratio = raw.samples_per_s / dec.samples_per_s
            if ratio >= _DECODE_BOUND_RATIO:
                return f"decode/transform bound (CPU): reading alone is {ratio:.1f}x faster"
            return "read bound (storage or decompression): skipping decoding is no faster"
    if cpu_count and workers >= cpu_count:
        return f"CPU bound: {workers} workers use all {cpu_count} cores"
    return "read or decode bound (sweep with and without --decode to tell)"


def _prefetch_at(
    results: Sequence[BenchResult], decode: bool, workers: int, tolerance: float
) -> BenchResult:
    """The smallest prefetch factor within ``tolerance`` of the best at ``workers``: prefetch
    beyond it holds more batches in memory for nothing."""
    points = [r for r in results if r.decode == decode and r.num_workers == workers]
    best = max(r.samples_per_s for r in points)
    ok = [r for r in points if r.samples_per_s >= (1 - tolerance) * best]
    return min(ok, key=lambda r: (r.prefetch_factor or 0, -r.samples_per_s))


def recommend(
    results: Sequence[BenchResult],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    cpu_count: int | None = None,
    memory_limit_mb: float | None = None,
) -> Recommendation:
    """Read the knee off the measured curve (the decoded one when both were measured).

    ``cpu_count`` lets the reason say "CPU bound"; ``memory_limit_mb`` caps the workers at
    the most whose measured memory fits.
    """
    if not results:
        raise UsageError("no measurements to recommend from")
    decode = any(r.decode for r in results)
    curve = _best_per_workers(results, decode)
    ys = [r.samples_per_s for r in curve]
    k = knee(ys, tolerance)
    chosen = curve[k]
    w = chosen.num_workers
    last = curve[-1].num_workers
    if len(curve) == 1:
        reason = f"only num_workers={w} was measured: sweep several values to find the knee"
    elif k == 0 and w == 0:
        reason = (
            "worker processes do not help: the data is small or cached, so their start-up "
            "and inter-process copies cost more than they bring"
        )
    elif k == len(curve) - 1:
        if cpu_count and last >= cpu_count:
            reason = (
                f"throughput still rises at {last} workers, all {cpu_count} cores: CPU bound; "
                "lighter transforms, a faster decoder or more cores would help"
            )
        else:
            reason = f"throughput still rises at {last} workers, the most tried: sweep higher"
    else:
        reason = f"more workers stop helping after {w}: {_bound(results, decode, w, cpu_count)}"
        peak = max(range(len(ys)), key=ys.__getitem__)
        if ys[-1] < (1 - tolerance) * ys[peak]:
            reason += (
                f"; beyond {curve[peak].num_workers} it gets slower (memory, context switches)"
            )
    if memory_limit_mb is not None and chosen.memory_mb > memory_limit_mb:
        fits = [r for r in curve[:k] if r.memory_mb <= memory_limit_mb]
        if fits:
            over = chosen.memory_mb
            chosen = max(fits, key=lambda r: r.num_workers)
            reason += (
                f"; capped at {chosen.num_workers} workers: {w} used {over:.0f} MB, "
                f"over the {memory_limit_mb:.0f} MB limit"
            )
            w = chosen.num_workers
    pick = _prefetch_at(results, decode, w, tolerance) if w > 0 else chosen
    return Recommendation(
        num_workers=w,
        prefetch_factor=pick.prefetch_factor if w > 0 else None,
        reason=reason,
        decode=decode,
        samples_per_s=pick.samples_per_s,
        memory_mb=pick.memory_mb,
        knee=curve[k].num_workers,
    )


# -- presentation ---------------------------------------------------------------------------

_COLUMNS = (
    ("decode", 6), ("workers", 7), ("prefetch", 8), ("batches/s", 9), ("samples/s", 10),
    ("MB/s", 8), ("first s", 7), ("peak MB", 8), ("PSS MB", 7),
)


def format_table(results: Sequence[BenchResult], rec: Recommendation | None = None) -> str:
    """A fixed-width table, the recommended point marked ``<- knee`` (``<- recommended
    (memory)`` when the memory limit moved it below the knee), the recommendation last."""
    head = "  ".join(f"{name:>{width}}" for name, width in _COLUMNS)
    lines = [head, "-" * len(head)]
    for r in results:
        cells = (
            "yes" if r.decode else "no",
            str(r.num_workers),
            "-" if r.prefetch_factor is None else str(r.prefetch_factor),
            f"{r.batches_per_s:.1f}",
            f"{r.samples_per_s:.0f}",
            f"{r.mb_per_s:.1f}",
            f"{r.first_batch_s:.2f}",
            f"{r.peak_rss_mb:.0f}",
            "-" if r.pss_mb is None else f"{r.pss_mb:.0f}",
        )
        line = "  ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS, strict=True))
        if rec is not None and (r.decode, r.num_workers, r.prefetch_factor) == (
            rec.decode, rec.num_workers, rec.prefetch_factor
        ):
            line += "  <- knee" if rec.knee == rec.num_workers else "  <- recommended (memory)"
        lines.append(line)
    if rec is not None:
        lines += ["", rec.line()]
    return "\n".join(lines)


def plot(results: Sequence[BenchResult], rec: Recommendation | None, path: str) -> None:
    """Throughput and memory against num_workers, one line per (decode, prefetch), as a PNG."""
    try:
        import matplotlib
    except ImportError as err:
        raise UsageError(
            "plotting needs matplotlib: pip install 'shardloader[plot]'"
        ) from err
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    try:
        series: dict[tuple[bool, int | None], list[BenchResult]] = {}
        for r in results:
            series.setdefault((r.decode, r.prefetch_factor), []).append(r)
        zero = {
            d: [r for r in results if r.decode == d and r.num_workers == 0] for d in (True, False)
        }
        for (decoded, pf), points in sorted(
            series.items(), key=lambda kv: (not kv[0][0], kv[0][1] or 0)
        ):
            if pf is None:
                continue  # num_workers=0 points start every prefetch line instead
            points = sorted(zero[decoded] + points, key=lambda r: r.num_workers)
            label = f"{'decoded' if decoded else 'raw bytes'}, prefetch {pf}"
            xs = [r.num_workers for r in points]
            style = "-o" if decoded else "--s"
            top.plot(xs, [r.samples_per_s for r in points], style, label=label)
            bottom.plot(xs, [r.memory_mb for r in points], style, label=label)
        if not any(pf is not None for _, pf in series):  # only num_workers=0 measured
            for decoded, points in zero.items():
                if points:
                    top.plot([0], [points[0].samples_per_s], "o",
                             label="decoded" if decoded else "raw bytes")
                    bottom.plot([0], [points[0].memory_mb], "o")
        if rec is not None:
            for ax in (top, bottom):
                ax.axvline(rec.num_workers, color="grey", linestyle=":", label="knee")
            top.set_title(rec.line(), fontsize=8, wrap=True)
        rates = [r.samples_per_s for r in results if r.samples_per_s > 0]
        if rates and max(rates) > 20 * min(rates):
            top.set_yscale("log")  # raw reading can be orders of magnitude above decoding
        top.set_xticks(sorted({r.num_workers for r in results}))
        top.set_ylabel("samples/s")
        bottom.set_ylabel("memory, MB (PSS or peak RSS)")
        bottom.set_xlabel("num_workers")
        top.legend(fontsize=7)
        top.grid(alpha=0.3)
        bottom.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
