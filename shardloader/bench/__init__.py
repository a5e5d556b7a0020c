"""Find the loader settings past which more workers stop helping: sweep, measure, recommend.

:func:`sweep` measures each (decode, num_workers, prefetch_factor) point
(:mod:`~shardloader.bench.measure`); :func:`knee` finds where the throughput curve flattens and
:func:`recommend` turns the curves into settings with a one-line reason
(:mod:`~shardloader.bench.recommend`, pure functions of the measurements, tested on made-up
curves); :func:`format_table` and :func:`plot` show them (:mod:`~shardloader.bench.report`).
``shardloader bench DATASET`` is the command.
"""

from shardloader.bench.measure import BenchResult, default_workers, measure, sweep
from shardloader.bench.recommend import DEFAULT_TOLERANCE, Recommendation, knee, recommend
from shardloader.bench.report import format_table, plot

__all__ = [
    "DEFAULT_TOLERANCE",
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
