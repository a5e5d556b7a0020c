"""Measure the loader at each (decode, num_workers, prefetch_factor) point of a sweep.

The method is the DataLoader article's (``shared/seed``), automated: for each ``num_workers``
(and ``prefetch_factor``), with and without decoding and transforms, read a fixed number of
batches after the first and record batches/s, samples/s, MB/s, the time to the first batch and
the memory of the whole process tree (main process plus workers).

Measured with the OS page cache warm (a first unrecorded pass stages the shards): a dataset
larger than memory, read cold, can be slower in training than here.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from shardloader.collate import collate_samples
from shardloader.dataset import ShardedDataset
from shardloader.deliver.loader import make_loader
from shardloader.errors import UsageError
from shardloader.presets import DatasetPreset

__all__ = ["BenchResult", "default_workers", "measure", "require_psutil", "sweep"]

_MB = 1e6


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
        rates = ("batches_per_s", "samples_per_s", "mb_per_s")
        return {**asdict(self), **{k: getattr(self, k) for k in rates}}


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
        self._psutil = psutil = require_psutil()
        self._root = psutil.Process()
        self._interval, self._refresh = interval_s, refresh_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardloader-bench-mem", daemon=True)
        self.peak = 0

    def _tree(self) -> list[Any]:
        try:
            return [self._root, *self._root.children(recursive=True)]
        except self._psutil.Error:
            return [self._root]

    def _total(self, procs: Iterable[Any], read: Callable[[Any], int]) -> int:
        """``read(process)`` summed over ``procs`` (a worker that just exited counts 0)."""
        total = 0
        for p in procs:
            with contextlib.suppress(self._psutil.Error):
                total += read(p)
        return total

    def sample(self, procs: Iterable[Any]) -> None:
        self.peak = max(self.peak, self._total(procs, lambda p: p.memory_info().rss))

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
        """Proportional set size of the tree now (shared pages split between sharers); None
        where the system does not tell it (not Linux)."""
        try:
            return self._total(self._tree(), lambda p: p.memory_full_info().pss)
        except AttributeError:
            return None


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
    preset: DatasetPreset | None = None,
    *,
    workers: Sequence[int] | None = None,
    prefetch: Sequence[int] = (2, 4),
    batches: int = 50,
    decode: Sequence[bool] = (True, False),
    warmup: bool = True,
    progress: Callable[[BenchResult], None] | None = None,
) -> list[BenchResult]:
    """Measure every (decode, num_workers, prefetch_factor) point on the dataset at ``url``,
    read as ``preset`` describes it (batch size, shuffle and seed, transform, storage, cache;
    default ``DatasetPreset(batch_size=32, transform="none")``), as ``shardloader bench`` reads
    it from the same flags.

    ``decode=True`` decodes with the preset's decoder and runs its transform; ``decode=False``
    reads raw bytes (no decoding, no transform): comparing the two tells reading from
    decoding.  Fields of unequal shapes are collated as lists, so a dataset of images of many
    sizes can be measured without a transform (one tensor per image then crosses from the
    worker: a resizing transform, as in training, is cheaper to move).  Each point reads the
    same first batches of epoch 0 (in stored order, or shuffled by the seed); ``warmup`` reads
    them once, unrecorded, so staging shards is not charged to the first point.
    """
    require_psutil()
    workers = tuple(default_workers() if workers is None else workers)
    if not workers or not decode:
        raise UsageError("give at least one num_workers value and one decode mode")
    if any(w > 0 for w in workers) and not prefetch:
        raise UsageError("give at least one prefetch_factor value for num_workers > 0")
    preset = preset or DatasetPreset(batch_size=32, transform="none")
    decoder, transform = preset.pipeline(url)
    collate = functools.partial(collate_samples, ragged="list")

    def dataset(decoded: bool) -> ShardedDataset:
        return preset.dataset(
            url,
            collate_fn=collate,
            decoder=decoder if decoded else None,
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
