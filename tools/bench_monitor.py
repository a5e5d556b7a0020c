"""What does ``shardloader.monitor`` cost per batch?  Prints ns/batch against a bare loop.

    python tools/bench_monitor.py [--batches 1000000] [--repeat 5]

The loader is a plain list, so the loop body is nothing but the iteration: the difference is
the wrapper's own cost (two ``perf_counter`` calls and a few additions per batch, plus a report
line every 100 batches, written to /dev/null here), which a real training step of milliseconds
dwarfs.  Best of ``--repeat`` runs each, to shed scheduler noise.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable

from shardloader.deliver.monitor import monitor


def _loop(iterable: Iterable[object]) -> float:
    started = time.perf_counter()
    for _ in iterable:
        pass
    return time.perf_counter() - started


def _clock_cost(n: int) -> float:
    clock = time.perf_counter
    started = clock()
    for _ in range(n):
        clock()
    return clock() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    batches = list(range(args.batches))
    sink = open(os.devnull, "w")  # the default report line, written where it costs no terminal
    runs = {
        "bare loop": lambda: _loop(batches),
        "monitor(enabled=False)": lambda: _loop(monitor(batches, enabled=False)),
        "monitor(interval=0)": lambda: _loop(monitor(batches, interval=0)),
        "monitor(report=None)": lambda: _loop(monitor(batches, report=None)),
        "monitor(interval=100)": lambda: _loop(
            monitor(batches, interval=100, report=sink, callback=lambda d: None)
        ),
    }
    best, cpu = {}, {}
    for name, run in runs.items():
        c = time.process_time()
        best[name] = min(run() for _ in range(args.repeat)) / args.batches * 1e9
        cpu[name] = (time.process_time() - c) / args.repeat / args.batches * 1e9
    bare = best["bare loop"]
    clock = min(_clock_cost(args.batches) for _ in range(args.repeat)) / args.batches * 1e9
    print(
        f"{args.batches} batches, best of {args.repeat}; one perf_counter() call here: "
        f"{clock:.0f} ns"
    )
    for name, ns in best.items():
        extra = "" if name == "bare loop" else f"  (+{ns - bare:.0f} ns/batch)"
        print(f"{name:>24}: {ns:8.1f} ns/batch{extra}; CPU {cpu[name]:.1f} ns/batch (mean)")
    sink.close()


if __name__ == "__main__":
    main()
