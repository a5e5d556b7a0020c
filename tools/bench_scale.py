"""Planning and first batch at 10^6 .. 10^9 samples, from a synthetic manifest.  One command::

    python tools/bench_scale.py                      # 1e6, 1e8, 1e9 samples, 3 runs each
    python tools/bench_scale.py --sizes 1e6,1e7 --runs 5 --batch-size 32 --world-size 1024

Up to ``--distinct-up-to`` samples (10^6) the dataset is real: every shard written.  Beyond it
the manifest is synthetic: one real, tiny Arrow shard (``--shard-samples`` samples of a few
bytes) listed again and again until the manifest holds N samples, so reading a batch is real
(sidecar checked, keys checked, rows read) while nothing else exists.  Each measurement runs in
a fresh interpreter (imports done first, not counted):

- ``open``: ``ShardedDataset(url, ...)``: reads and checks the manifest (one GET);
- ``plan``: ``len(ds)``: plans the shuffled epoch for rank 0 of ``--world-size`` (what every
  DataLoader worker does again at the start of each pass) and works out the first step's ids;
  its memory is tracemalloc's peak (every numpy and Python allocation) and the growth of the
  process's peak RSS;
- ``first batch``: ``next(iter(ds))`` after ``open``: plan, open the shard(s) the first batch
  reads, read and collate it; ``TTFB`` = open + first batch;
- ``worker``: the largest unique (USS) and resident (RSS) memory of the two DataLoader workers
  of ``make_loader(ds, num_workers=2)`` after its first batch (forked: RSS counts pages shared
  with the parent, USS only the worker's own), and ``TTFB, 2 workers``: open + the loader's
  first batch (workers started, each planning its pass).

``--materialised`` also times the order as it was before it was lazy (``epoch_order``: 8 bytes
a sample) up to 10^7 samples.  Output: a Markdown table of medians, and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_CHILD = r"""
import json, resource, sys, time, tracemalloc
import numpy as np
import shardloader as sl
from shardloader.dataset import ShardedDataset
from shardloader.plan.steps import WorkerSteps
url, batch, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
per_node = int(sys.argv[5]) or None
def rss_peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = {}
if mode == "materialised":
    from shardloader.manifest import read_manifest
    from shardloader.plan.order import epoch_order
    from shardloader.plan.shuffle import ShuffleOptions
    manifest, _ = read_manifest(url)
    base = rss_peak()
    tracemalloc.start()
    t = time.perf_counter()
    order = epoch_order(manifest.shard_sizes, 0, 0, ShuffleOptions())
    batches = list(order.reshape(-1, batch)[: len(order) // batch])
    out["plan_s"] = time.perf_counter() - t
    out["plan_peak"] = tracemalloc.get_traced_memory()[1]
    out["plan_rss"] = rss_peak() - base
else:
    t = time.perf_counter()
    ds = ShardedDataset(url, batch_size=batch, shuffle=True, decoder=None,
                        world=sl.World(0, world, ranks_per_node=per_node))
    out["open_s"] = time.perf_counter() - t
    if mode == "plan":
        base = rss_peak()
        tracemalloc.start()
        t, c = time.perf_counter(), time.process_time()
        steps = len(ds)
        from shardloader.plan.epoch import EpochPlanner
        planner = EpochPlanner(ds.manifest.shard_sizes, ds.seed, ds.shuffle, ds.uneven, batch)
        plan = planner.plan(ds.epoch, ds.position, ds.rank, ds.world_size, None, (), ds.partition)
        first = WorkerSteps(plan, 0, 1)[0]
        out["plan_s"] = time.perf_counter() - t
        out["plan_cpu_s"] = time.process_time() - c  # one process: its CPU is the tree's
        out["plan_peak"] = tracemalloc.get_traced_memory()[1]
        out["plan_rss"] = rss_peak() - base
        out["steps"] = steps
        out["first_ids"] = first[:3].tolist()
    elif mode == "workers":
        import psutil
        loader = sl.make_loader(ds, num_workers=2)
        t = time.perf_counter()
        it = iter(loader)
        first = next(it)
        out["worker_ttfb_s"] = out["open_s"] + time.perf_counter() - t
        kids = psutil.Process().children()
        out["worker_uss"] = sorted(k.memory_full_info().uss for k in kids)[-1]
        out["worker_rss"] = sorted(k.memory_info().rss for k in kids)[-1]
        del it
    else:
        t = time.perf_counter()
        first = next(iter(ds))
        out["first_s"] = time.perf_counter() - t
        out["ttfb_s"] = out["open_s"] + out["first_s"]
        out["rss"] = rss_peak()
print(json.dumps(out))
"""


def write_synthetic(folder: str, num_samples: int, shard_samples: int, distinct: bool) -> str:
    """One real Arrow shard of ``shard_samples`` tiny samples, listed until ``num_samples``
    (``distinct``: a real dataset, every shard written)."""
    from synthetic import write_manifest

    from shardloader.manifest import FieldInfo, Manifest

    os.makedirs(folder, exist_ok=True)
    fields = {"bin": FieldInfo("bytes"), "cls": FieldInfo("int")}
    count = -(-num_samples // shard_samples)
    if distinct:
        infos = [_write_shard(folder, n, n * shard_samples, shard_samples) for n in range(count)]
    else:
        infos = [_write_shard(folder, 0, 0, shard_samples)] * count
    write_manifest(folder, Manifest("arrow", "none", fields, infos))
    return folder


def _write_shard(folder: str, n: int, first: int, shard_samples: int) -> Any:
    from synthetic import shard_name, write_shard

    from shardloader.manifest import FieldInfo

    fields = {"bin": FieldInfo("bytes"), "cls": FieldInfo("int")}
    samples = (
        (f"s/{i:07d}", {"bin": i.to_bytes(4, "little"), "cls": b"%d" % (i % 10)})
        for i in range(first, first + shard_samples)
    )
    return write_shard(folder, shard_name(n, "arrow"), "arrow", "none", fields, samples)


PER_NODE = [0]  # --ranks-per-node (0: unknown, one partition)


def run_child(url: str, batch: int, world: int, mode: str) -> dict[str, float]:
    env = dict(os.environ)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, url, str(batch), str(world), mode, str(PER_NODE[0])],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{mode} at {url} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="1e6,1e8,1e9", help="samples, comma-separated")
    ap.add_argument("--shard-samples", type=int, default=100_000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument(
        "--ranks-per-node",
        type=int,
        default=0,
        help="plan node partitions of this many ranks (default: unknown, one partition)",
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--materialised", action="store_true", help="also time epoch_order (<=1e7)")
    ap.add_argument(
        "--distinct-up-to", type=float, default=1e6, help="write every shard up to this size"
    )
    ap.add_argument("--work", default=None, help="folder for the synthetic datasets (temp)")
    args = ap.parse_args()
    PER_NODE[0] = args.ranks_per_node
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        for n in sizes:
            distinct = n <= args.distinct_up_to
            url = write_synthetic(os.path.join(work, f"n{n}"), n, args.shard_samples, distinct)
            runs: dict[str, list[dict[str, float]]] = {
                "plan": [],
                "read": [],
                "workers": [],
                "materialised": [],
            }
            for _ in range(args.runs):  # interleaved, so load hits both alike
                runs["plan"].append(run_child(url, args.batch_size, args.world_size, "plan"))
                runs["read"].append(run_child(url, args.batch_size, args.world_size, "read"))
                runs["workers"].append(run_child(url, args.batch_size, args.world_size, "workers"))
                if args.materialised and n <= 10**7:
                    runs["materialised"].append(
                        run_child(url, args.batch_size, args.world_size, "materialised")
                    )

            def med(mode: str, key: str, runs: dict[str, list[dict[str, float]]] = runs) -> float:
                return statistics.median(r[key] for r in runs[mode])

            row = {
                "n": n,
                "shards": -(-n // args.shard_samples),
                "open_s": med("plan", "open_s"),
                "plan_s": med("plan", "plan_s"),
                "plan_cpu_s": med("plan", "plan_cpu_s"),
                "plan_mb": med("plan", "plan_peak") / 1e6,
                "plan_rss_mb": med("plan", "plan_rss") / 1e6,
                "ttfb_s": med("read", "ttfb_s"),
                "first_s": med("read", "first_s"),
                "steps": runs["plan"][0]["steps"],
                "uss_mb": med("workers", "worker_uss") / 1e6,
                "wttfb_s": med("workers", "worker_ttfb_s"),
                "wrss_mb": med("workers", "worker_rss") / 1e6,
                "data": "real shards" if distinct else "one shard, repeated",
            }
            if runs["materialised"]:
                row["old_s"] = med("materialised", "plan_s")
                row["old_mb"] = med("materialised", "plan_peak") / 1e6
            rows.append(row)
            print(f"measured {n:.0e} samples", file=sys.stderr, flush=True)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\nshuffled epoch, batch {args.batch_size}, rank 0 of {args.world_size}, "
        f"{args.shard_samples:,} samples a shard; median of {args.runs} fresh processes; "
        f"{os.cpu_count()} CPUs, load average {load}\n"
    )
    head = (
        "| samples | shards | open (manifest) | plan | plan peak (tracemalloc) | plan RSS growth "
        "| first batch | TTFB | TTFB, 2 workers | worker USS / RSS | steps/rank |"
    )
    print(head)
    print("|" + "---|" * 11)
    for r in rows:
        print(
            f"| {r['n']:.0e} ({r['data']}) | {r['shards']:,} | {r['open_s'] * 1e3:.0f} ms "
            f"| {r['plan_s'] * 1e3:.0f} ms (CPU {r.get('plan_cpu_s', float('nan')) * 1e3:.0f}) "
            f"| {r['plan_mb']:.1f} MB | {r['plan_rss_mb']:.1f} MB "
            f"| {r['first_s'] * 1e3:.0f} ms | {r['ttfb_s'] * 1e3:.0f} ms "
            f"| {r['wttfb_s'] * 1e3:.0f} ms "
            f"| {r['uss_mb']:.0f} / {r['wrss_mb']:.0f} MB | {r['steps']:,} |"
        )
    old = [r for r in rows if "old_s" in r]
    if old:
        print("\nthe order materialised (epoch_order + batches, as before it was lazy):\n")
        print("| samples | plan | plan peak (tracemalloc) | lazy / materialised time |")
        print("|---|---|---|---|")
        for r in old:
            ratio = r["plan_s"] / r["old_s"] if r["old_s"] else float("nan")
            print(
                f"| {r['n']:.0e} | {r['old_s'] * 1e3:.0f} ms | {r['old_mb']:.1f} MB | {ratio:.2f} |"
            )


if __name__ == "__main__":
    main()
