"""Run a snippet in a fresh interpreter and measure how far its process tree's memory grows.

Used by the decompression-bomb tests: the code under test runs in a child (so a bug cannot
balloon the test process), under safety nets — address space capped a few GiB above what the
child has mapped, files capped at ``max_file`` (an oversized write fails with EFBIG instead of
filling the disk) — and reports the growth of its resident memory while the snippet ran: the
larger of the sampled RSS of the child and its children (every 5 ms) and the growth of the
child's kernel-recorded peak RSS (which no sampling can miss).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

_CHILD = r"""
import gc, json, os, resource, signal, sys, threading, time, traceback
import psutil

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({max_file}, {max_file}))
# `import shardloader` is lazy: import what reading needs (torch above all) before the baseline,
# so the measured growth is what the data causes, not the libraries.
import shardloader.dataset, shardloader.pack.index_existing  # noqa: E401
import shardloader.read.summary, shardloader.read.verify  # noqa: E401
{setup}
proc = psutil.Process()
resource.setrlimit(resource.RLIMIT_AS, (proc.memory_info().vms + {max_extra_vm}, -1))

def tree_rss():
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total

gc.collect()
before = tree_rss()
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
sampled = [before]
running = True

def sample():
    while running:
        sampled[0] = max(sampled[0], tree_rss())
        time.sleep(0.005)

thread = threading.Thread(target=sample, daemon=True)
thread.start()
result, error = None, None
t0 = time.perf_counter()
try:
{action}
except BaseException as err:
    error = {{"type": type(err).__name__, "message": str(err),
             "traceback": traceback.format_exc()}}
seconds = time.perf_counter() - t0
running = False
thread.join()
peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
growth = max(sampled[0] - before, peak_after - peak_before)
print("MEMCHECK " + json.dumps({{"growth": growth, "error": error, "result": result,
                                "seconds": seconds}}))
"""


def run_measured(
    setup: str,
    action: str,
    *,
    max_file: int = 512 << 20,
    max_extra_vm: int = 4 << 30,
    timeout: float = 120,
) -> dict[str, Any]:
    """Run ``setup`` then ``action`` (which may set ``result``) in a child interpreter.

    Returns ``{"growth": bytes, "error": {"type", "message", "traceback"} | None, "result",
    "seconds"}``.
    """
    code = _CHILD.format(
        setup=textwrap.dedent(setup),
        action=textwrap.indent(textwrap.dedent(action), "    "),
        max_file=max_file,
        max_extra_vm=max_extra_vm,
    )
    import shardloader

    env = dict(os.environ)  # the child imports the shardloader this process imported
    env["PYTHONPATH"] = os.pathsep.join(
        p
        for p in (os.path.dirname(os.path.dirname(shardloader.__file__)), env.get("PYTHONPATH"))
        if p
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )
    for line in proc.stdout.splitlines():
        if line.startswith("MEMCHECK "):
            report: dict[str, Any] = json.loads(line[len("MEMCHECK ") :])
            log = os.environ.get("MEMCHECK_LOG")  # collect the figures of a run
            if log:
                with open(log, "a") as f:
                    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
                    f.write(
                        f"{test}\tgrowth {report['growth'] / 2**20:.1f} MiB\t"
                        f"{report['seconds']:.2f} s\n"
                    )
            return report
    raise AssertionError(
        f"child exited {proc.returncode} without a report:\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-3000:]}"
    )
