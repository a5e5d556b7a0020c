"""Read the knee off measured curves and turn it into loader settings with a one-line reason.

Pure functions of the measurements (:class:`~shardloader.bench.measure.BenchResult`), so they
are tested on made-up curves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from shardloader.bench.measure import BenchResult
from shardloader.errors import UsageError

__all__ = ["DEFAULT_TOLERANCE", "Recommendation", "knee", "recommend"]

DEFAULT_TOLERANCE = 0.10  # within 10 % of the best throughput counts as "as fast"
_DECODE_BOUND_RATIO = 1.5  # reading alone this much faster than decoding: decode-bound


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
