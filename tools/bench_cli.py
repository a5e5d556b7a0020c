"""How long does the ``shardloader`` command take to answer?  Prints medians of fresh runs.

    python tools/bench_cli.py [--runs 7]

Each case starts a new process, as a user's shell does: ``shardloader --help``,
``shardloader pack --help``, a usage error (``shardloader pack`` without arguments) and
``shardloader cache info`` (which imports the storage layer); for reference, a bare
``python -c pass`` and ``python -c 'import torch'``.  Wall-clock medians, so a busy machine
shows up as noise, not as a bias; beside them the CPU seconds (user + sys) of the command's
process tree, which the machine's load barely moves.  The goal is under 0.3 s for help and
usage errors; tests check the cause instead of the time (tests/test_cli_imports.py: no torch,
numpy or pyarrow imported for them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _command() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m shardloader``."""
    script = os.path.join(os.path.dirname(sys.executable), "shardloader")
    if os.path.exists(script):
        return [script]
    found = shutil.which("shardloader")
    return [found] if found else [sys.executable, "-m", "shardloader"]


def _time(argv: list[str], runs: int, env: dict[str, str]) -> tuple[float, float, int]:
    """(median wall seconds, median CPU seconds of the command's process tree, exit code)."""
    times, cpus = [], []
    code = 0
    for _ in range(runs):
        started, before = time.perf_counter(), os.times()
        done = subprocess.run(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False
        )
        times.append(time.perf_counter() - started)
        after = os.times()  # the command and whatever it waited for: user + sys
        cpus.append(
            after.children_user
            - before.children_user
            + after.children_system
            - before.children_system
        )
        code = done.returncode
    return statistics.median(times), statistics.median(cpus), code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per case")
    args = parser.parse_args()
    cli = _command()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "SHARDLOADER_CACHE_DIR": cache}  # `cache info` on an empty cache
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "shardloader --help": [*cli, "--help"],
            "shardloader pack --help": [*cli, "pack", "--help"],
            "shardloader pack (usage error)": [*cli, "pack"],
            "shardloader cache info": [*cli, "cache", "info"],
        }
        print(f"{' '.join(cli)}: median of {args.runs} fresh runs each")
        for name, argv in cases.items():
            seconds, cpu, code = _time(argv, args.runs, env)
            print(f"{name:>32}: {seconds:6.3f} s, CPU {cpu:6.3f} s  (exit {code})")


if __name__ == "__main__":
    main()
