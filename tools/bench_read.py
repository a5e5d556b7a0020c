"""Read throughput of shardloader against its peers, on the same real corpora, in one run.

One command (in a venv with the peers: ``pip install litdata mosaicml-streaming datasets
webdataset psutil``; ``/work/main/.venv-bench`` has them)::

    python tools/bench_read.py --images 20000 --docs 200000 --repeat 3

What it measures is what a user runs:

* **corpus**: ``tools/make_corpus.py --jpeg-only`` (RGB JPEGs of 160-640 x 120-480 px, ~30 KB,
  100 class folders; JSONL documents of lognormal length), generated once under ``--work`` and
  reused while its parameters match;
* **writers**: every system writes the same samples its own way; shardloader with its CLI
  (``shardloader pack``: tar + zstd, and ``--format arrow``), the peers with theirs;
* **readers**: raw (undecoded) samples, batches of ``--batch-size`` (32), shuffled, with
  ``num_workers`` 0 and 2; the loop touches every sample's payload.  shardloader is read with
  its fastest documented path, ``collate_fn=RawCollate()`` (a :class:`RawBatch`: one buffer per
  field), and with a list of sample dicts (``shardloader-dicts``) like the peers;
* **every measurement in a fresh process** (imports before the clock, as in a training script),
  interleaved: each repeat runs every (system, workers) once, in a rotated order; medians over
  ``--repeat``;
* samples/s in the steady state (from the first batch to the last), the **time to the first
  batch** (from constructing the dataset and loader), and the **peak anonymous memory** of the
  process tree (``Pss_Anon`` of the process and its workers summed, sampled every second: shared
  copy-on-write pages counted once);
* the machine's load (``os.getloadavg()``) before each run; the table shows its median per row.

Ratios are shardloader's figure over the best peer's (``vs best peer``), and each Arrow row over
the tar row (``arrow vs tar``).  ``--systems`` picks systems (``shardloader-noverify`` measures
the per-sample checksum's cost; ``shardloader-baseline`` with ``--baseline DIR`` another
checkout, and any shardloader system with ``@baseline`` appended, for before/after figures),
``--max-seconds`` caps one run (slow peers), ``--json FILE`` keeps every run and the medians,
``--profile DIR`` adds one run per row before the repeats, profiled (cProfile of the reading
process's steady state: with workers, what the training process pays to receive) and left out
of the table.
CPU per sample is the whole process tree's (the process and its workers: ``cputree.py``).
``tools/bench_shuffle.py`` measures shuffle quality.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import read_systems as rs  # noqa: E402
from benchjson import write_figures  # noqa: E402
from cputree import TreeCPU  # noqa: E402

DEFAULT_SYSTEMS = ",".join(["shardloader", "shardloader-dicts", "shardloader-arrow", *rs.PEERS])


# ----------------------------------------------------------------------------------- corpus


def prepare(work: str, images: int, docs: int, systems: list[str]) -> dict[str, dict[str, str]]:
    """Generate the corpus (once) and write it for every system; ``{corpus: {system: where}}``."""
    import make_corpus

    corpus_dir = os.path.join(work, "corpus")
    params = {"images": images, "docs": docs, "classes": 100, "seed": 0, "mixed": False}
    stamp = os.path.join(work, "corpus.params.json")
    if not _matches(stamp, params):
        make_corpus.make_corpus(corpus_dir, images, 100, docs, doc_files=8, seed=0, mixed=False)
        _write_json(stamp, params)
    where: dict[str, dict[str, str]] = {}
    for corpus, count in (("images", images), ("docs", docs)):
        if not count:
            continue
        where[corpus] = {}
        for system in systems:
            variant = rs.SHARDLOADER.get(_kind(system))
            name = f"shardloader-{variant[0]}" if variant else system
            out = os.path.join(work, corpus, name)
            done = os.path.join(work, corpus, f"{name}.done.json")
            if not _matches(done, params):
                t0 = time.perf_counter()
                rs.write_system(_kind(system), corpus_dir, corpus, out)
                print(
                    f"wrote {corpus} for {name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr
                )
                _write_json(done, params)
            where[corpus][system] = out
    return where


def _matches(path: str, params: dict[str, Any]) -> bool:
    try:
        with open(path) as f:
            return json.load(f) == params  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return False


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f)


# ----------------------------------------------------------------------------------- one run


class PeakAnon:
    """The largest ``Pss_Anon`` summed over this process and its descendants."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        total = 0
        for pid in [os.getpid(), *_descendants(os.getpid())]:
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss_Anon:"):
                            total += int(line.split()[1]) * 1024
                            break
            except OSError:  # a worker that just exited
                pass
        self.peak = max(self.peak, total)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def __enter__(self) -> PeakAnon:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this fresh process."""
    system, corpus, where = _kind(spec["system"]), spec["corpus"], spec["where"]
    field = rs.payload_field(system, corpus)
    rs.import_system(system)
    load = os.getloadavg()[0]
    with PeakAnon() as memory:
        t0 = time.perf_counter()
        loader = rs.make_loader(system, where, spec["workers"], spec["batch_size"])
        it = iter(loader)
        n, nbytes = rs.count_batch(next(it), field)
        t_first = time.perf_counter()
        memory.sample()
        tree = TreeCPU().start()  # the process, its workers (alive, or joined: cputree.py)
        profiler = _start_profile(spec)
        own = _own_cpu()
        first_n = n
        deadline = t_first + spec["max_seconds"]
        for batch in it:
            k, b = rs.count_batch(batch, field)
            n, nbytes = n + k, nbytes + b
            if time.perf_counter() > deadline:
                break
        t_end = time.perf_counter()
        _stop_profile(profiler, spec)
        own = _own_cpu() - own
        tree.stop()
        memory.sample()
    steady = max(t_end - t_first, 1e-9)
    steady_n = max(n - first_n, 1)
    return {
        **{k: spec[k] for k in ("system", "corpus", "workers")},
        "samples": n,
        "samples_s": (n - first_n) / steady,
        "mb_s": nbytes * (n - first_n) / max(n, 1) / steady / 1e6,
        "first_batch_s": t_first - t0,
        "peak_anon_mb": memory.peak / 2**20,
        # CPU in the steady state, per sample: this process, its workers, and all of them
        "cpu_us": own / steady_n * 1e6,
        "worker_cpu_us": (tree.seconds - own) / steady_n * 1e6,
        "tree_cpu_us": tree.seconds / steady_n * 1e6,
        "load": load,
    }


def _start_profile(spec: dict[str, Any]) -> Any:
    """cProfile of this process's steady state, when ``--profile DIR`` asked for one (the
    reading process itself: with workers, what the training process pays to receive)."""
    if not spec.get("profile"):
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _stop_profile(profiler: Any, spec: dict[str, Any]) -> None:
    if profiler is None:
        return
    profiler.disable()
    name = f"{spec['system']}-{spec['corpus']}-w{spec['workers']}.prof".replace("@", "-")
    profiler.dump_stats(os.path.join(spec["profile"], name))


def print_profiles(folder: str, top: int = 12) -> None:
    """The top costs (own time) of each profiled run, one table per (system, corpus, workers)."""
    import pstats

    for name in sorted(os.listdir(folder)):
        if name.endswith(".prof"):
            print(f"\n## profile {name} (steady state, own time)", file=sys.stderr)
            stats = pstats.Stats(os.path.join(folder, name), stream=sys.stderr)
            stats.sort_stats("tottime").print_stats(top)


def _kind(system: str) -> str:
    """``shardloader-arrow@baseline`` is read as ``shardloader-arrow``, from ``--baseline``."""
    return system.split("@", 1)[0]


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def run_child(spec: dict[str, Any], baseline: str | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    if spec["system"] == "shardloader-baseline" or spec["system"].endswith("@baseline"):
        if not baseline:
            raise SystemExit(f"system {spec['system']} needs --baseline CHECKOUT")
        env["PYTHONPATH"] = baseline  # that checkout's shardloader, with sample dicts
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode != 0:
        raise SystemExit(f"{spec['system']} {spec['corpus']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------------- table


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        rows.setdefault((r["corpus"], r["workers"], r["system"]), []).append(r)
    out = []
    for (corpus, workers, system), rs_ in rows.items():
        med = {
            k: statistics.median(r[k] for r in rs_)
            for k in rs_[0]
            if k not in ("system", "corpus", "workers")
        }
        out.append(
            {"corpus": corpus, "workers": workers, "system": system, **med, "runs": len(rs_)}
        )
    return out


def _cpu(r: dict[str, Any]) -> str:
    if not r["workers"]:
        return f"{r['tree_cpu_us']:.1f}"
    return f"{r['cpu_us']:.1f} + {r['worker_cpu_us']:.1f} = {r['tree_cpu_us']:.1f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| corpus | workers | system | samples/s | MB/s | vs best peer | CPU µs/sample: main "
        "+ workers = all | CPU vs best peer | first batch (s) | peak anon (MB) | load |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        for workers in sorted({r["workers"] for r in rows}):
            group = [r for r in rows if r["corpus"] == corpus and r["workers"] == workers]
            peers = [r for r in group if r["system"] in rs.PEERS]
            best = max((r["samples_s"] for r in peers), default=float("nan"))
            # the peer that spends the least CPU a sample: "CPU vs best peer" is its figure
            # over ours (above 1: we spend less)
            frugal = min((r["tree_cpu_us"] for r in peers), default=float("nan"))
            least = min((r["peak_anon_mb"] for r in peers), default=float("nan"))
            for r in sorted(group, key=lambda r: -r["samples_s"]):
                print(
                    f"| {corpus} | {workers} | {r['system']} | {r['samples_s']:,.0f} | "
                    f"{r['mb_s']:,.0f} | {r['samples_s'] / best:.2f}x | {_cpu(r)} | "
                    f"{frugal / r['tree_cpu_us']:.2f}x | {r['first_batch_s']:.3f} "
                    f"| {r['peak_anon_mb']:,.0f} | {r['load']:.1f} |"
                )
            ours = [r for r in group if r["system"] == "shardloader"]
            if ours and peers:
                print(
                    f"| {corpus} | {workers} | *shardloader / best peer* | | | "
                    f"**{ours[0]['samples_s'] / best:.2f}x** | | "
                    f"**{frugal / ours[0]['tree_cpu_us']:.2f}x** | | "
                    f"**{ours[0]['peak_anon_mb'] / least:.2f}x** of the least | |"
                )
    arrow = [r for r in rows if r["system"] == "shardloader-arrow"]
    if arrow:
        print("\n| corpus | workers | arrow samples/s | tar samples/s | arrow vs tar |")
        print("|---|---:|---:|---:|---:|")
        for a in arrow:
            tar = [
                r
                for r in rows
                if r["system"] == "shardloader"
                and r["corpus"] == a["corpus"]
                and r["workers"] == a["workers"]
            ]
            if tar:
                t = tar[0]["samples_s"]
                print(
                    f"| {a['corpus']} | {a['workers']} | {a['samples_s']:,.0f} | {t:,.0f} | "
                    f"{a['samples_s'] / t:.2f}x |"
                )


# ----------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--docs", type=int, default=200000)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=30.0, help="cap on one run's reading")
    ap.add_argument("--work", default="bench-out/read")
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS)
    ap.add_argument("--json", help="write every run and the medians here")
    ap.add_argument(
        "--baseline",
        help="another checkout of shardloader, measured as system shardloader-baseline "
        "(sample dicts) or as any shardloader system with @baseline appended "
        "(shardloader@baseline), interleaved with the others: before/after figures in one run",
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="one more run of each (system, corpus, workers) before the repeats, its steady "
        "state profiled (cProfile) into DIR/<system>-<corpus>-w<workers>.prof and left out of "
        "the table; their top costs are printed at the end",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        os._exit(0)  # some peers leave threads that would hold the exit up
    systems = args.systems.split(",")
    workers = [int(w) for w in args.workers.split(",")]
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    where = prepare(args.work, args.images, args.docs, systems)
    import compileall

    import shardloader

    # What pip leaves behind: compiled modules (with PYTHONDONTWRITEBYTECODE set, a source
    # checkout would compile every lazily imported module inside the clock; the peers' are)
    package = os.path.dirname(shardloader.__file__)
    compileall.compile_dir(package, quiet=1)
    print(f"shardloader from {package}", file=sys.stderr)
    runs = []
    for corpus, places in where.items():
        # with --profile, one more run per row first (rep -1), profiled and left out of the table
        for rep in range(-1 if args.profile else 0, args.repeat):
            for w in workers:
                shift = (rep + w) % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    spec = {
                        "system": system,
                        "corpus": corpus,
                        "where": places[system],
                        "workers": w,
                        "batch_size": args.batch_size,
                        "max_seconds": args.max_seconds,
                        "profile": os.path.abspath(args.profile) if rep < 0 else None,
                    }
                    r = run_child(spec, args.baseline)
                    if rep >= 0:
                        runs.append(r)
                    print(
                        f"{corpus:6s} rep {rep} workers={w} {system:20s} {r['samples_s']:10,.0f}/s "
                        f"first {r['first_batch_s']:.3f}s anon {r['peak_anon_mb']:.0f} MB "
                        f"cpu {_cpu(r)} us load {r['load']:.1f}",
                        file=sys.stderr,
                    )
    loads = [r["load"] for r in runs] or [float("nan")]
    print(
        f"\n{len(runs)} runs, each in a fresh process; medians of {args.repeat}; batch "
        f"{args.batch_size}; {os.cpu_count()} cores, load {min(loads):.1f}..{max(loads):.1f} "
        f"(1-min average before each run)"
    )
    print_table(summarize(runs))
    if args.profile:
        print_profiles(args.profile)
    if args.json:
        write_figures(
            args.json, __file__, {"runs": runs, "rows": summarize(runs), "cores": os.cpu_count()}
        )


if __name__ == "__main__":
    main()
