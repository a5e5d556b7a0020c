"""Raw reads, shardloader against LitData: a second harness, written from the goals' workload.

    PYTHONPATH=. python tools/bench_peers.py [--images 20000] [--docs 200000] [--repeat 3]
                                             [--workers 0,2] [--batch 32] [--json FILE]

Independent of ``tools/bench_read.py`` on purpose (its own corpus, writers, timing and CPU
count), so that the two agreeing means something:

* corpus (generated here, once under ``--work``): ``--images`` JPEGs of 256 x 256 (~23 KB, a
  smooth random field plus grain, quality 90) in 100 class folders, and ``--docs`` JSONL
  documents ``{"id", "text"}`` of lognormal length (~1.5 KB mean) in 8 files: the goals'
  20,000 images (470 MB) and 200,000 documents (305 MB);
* writers, each system's documented way with its defaults: ``shardloader pack`` (tar, and
  ``--format arrow``; 2 workers), LitData ``optimize`` (2 workers, 64 MB chunks);
* readers, what a user of each writes for shuffled raw bytes in batches of ``--batch``:
  ``ShardedDataset(decoder=None, collate_fn=RawCollate())`` + ``make_loader`` (shardloader's
  documented raw path), ``StreamingDataset`` + ``StreamingDataLoader`` (default collate); the
  DataLoader's default start method; every sample's payload is touched (its length summed);
* every run a fresh process, one epoch; the (corpus, workers, system) runs of a repeat are
  rotated between repeats; one unmeasured warm-up run per system and corpus first (page cache
  and shardloader's node cache warm alike); medians of ``--repeat``;
* samples/s from the first batch to the end of the epoch; CPU per sample over the same span, of
  the whole process tree (the process, its reaped children and every live descendant, from
  psutil); the 1-minute load average before each run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing import Pool
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchjson import write_figures  # noqa: E402

SYSTEMS = ("shardloader-tar", "shardloader-arrow", "litdata")
FIELD = {("shardloader", "images"): "image", ("shardloader", "docs"): "json"}
FIELD |= {("litdata", "images"): "jpg", ("litdata", "docs"): "json"}
LETTERS = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz ", np.uint8)
WEIGHTS = np.array([12.7, 9.1, 8.2, 7.5, 7, 6.7, 6.3, 6.1, 6, 4.3, 4, 2.8, 2.8, 2.4, 2.4, 2.2, 2])
WEIGHTS = np.concatenate([WEIGHTS, [2, 1.9, 1.5, 1, 0.8, 0.2, 0.2, 0.1, 0.1, 20.0]])


# ------------------------------------------------------------------------------ corpus


def _image(i: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng([7, i])
    low = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    pixels = np.asarray(low.resize((256, 256), Image.Resampling.BICUBIC), np.int16)
    pixels = pixels + rng.integers(-15, 16, (256, 256, 3))
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def _write_image(args: tuple[str, int]) -> None:
    root, i = args
    folder = os.path.join(root, f"class-{i % 100:03d}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{i:07d}.jpg"), "wb") as f:
        f.write(_image(i))


def _write_docs(args: tuple[str, int, int, int]) -> None:
    root, part, start, count = args
    rng = np.random.default_rng([8, part])
    lengths = np.maximum(rng.lognormal(np.log(1450) - 0.5, 1.0, count).astype(np.int64), 16)
    text = rng.choice(LETTERS, int(lengths.sum()), p=WEIGHTS / WEIGHTS.sum()).tobytes().decode()
    ends = np.cumsum(lengths)
    with open(os.path.join(root, f"part-{part:02d}.jsonl"), "w") as f:
        for i, (end, n) in enumerate(zip(ends, lengths, strict=True)):
            f.write(json.dumps({"id": start + i, "text": text[end - n : end]}) + "\n")


def _litdata_image(item: tuple[str, int]) -> dict[str, Any]:
    with open(item[0], "rb") as f:
        return {"key": os.path.basename(item[0]), "jpg": f.read(), "cls": item[1]}


def _litdata_docs(path: str) -> Any:
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            yield {"key": f"{os.path.basename(path)}/{i}", "json": line.rstrip(b"\n")}


def build(work: str, images: int, docs: int, systems: list[str]) -> None:
    """Generate the corpus and write it for each of ``systems``, unless ``work`` has them."""
    params = {"images": images, "docs": docs, "v": 1}
    src = {c: os.path.join(work, "src", c) for c in ("images", "docs")}
    if not _stamped(os.path.join(work, "src"), params):
        import shutil

        for old in ("src", "images", "docs", "cache"):  # what an older corpus left
            shutil.rmtree(os.path.join(work, old), ignore_errors=True)
        os.makedirs(src["docs"])
        per = -(-docs // 8)
        with Pool() as pool:
            pool.map(_write_image, [(src["images"], i) for i in range(images)], chunksize=256)
            parts = [(src["docs"], p, p * per, min(per, docs - p * per)) for p in range(8)]
            pool.map(_write_docs, [p for p in parts if p[3] > 0])
        _stamp(os.path.join(work, "src"), params)
    for corpus in ("images", "docs"):
        for system in systems:
            out = os.path.join(work, corpus, system)
            if _stamped(out, params):
                continue
            if system == "litdata":
                _optimize(src[corpus], corpus, out)
            else:
                fmt = system.split("-")[1]
                cmd = [sys.executable, "-m", "shardloader", "pack", src[corpus], out, "-q"]
                cmd += ["--format", fmt, "--workers", "2", "--overwrite"]
                subprocess.run(cmd, check=True)
            _stamp(out, params)


def _optimize(src: str, corpus: str, out: str) -> None:
    from litdata import optimize

    fn: Callable[..., Any] = _litdata_docs
    inputs: list[Any] = sorted(os.path.join(src, name) for name in os.listdir(src))
    if corpus == "images":
        fn, inputs = (
            _litdata_image,
            [
                (os.path.join(src, c, name), label)
                for label, c in enumerate(sorted(os.listdir(src)))
                for name in sorted(os.listdir(os.path.join(src, c)))
            ],
        )
    optimize(
        fn=fn, inputs=inputs, output_dir=out, chunk_bytes="64MB", num_workers=2, mode="overwrite"
    )


def _stamped(path: str, params: dict[str, Any]) -> bool:
    try:
        with open(path + ".done.json") as f:
            return json.load(f) == params  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return False


def _stamp(path: str, params: dict[str, Any]) -> None:
    with open(path + ".done.json", "w") as f:
        json.dump(params, f)


# ------------------------------------------------------------------------------ one run


def tree_cpu() -> float:
    """CPU seconds of this process, its reaped children and every live descendant."""
    import psutil

    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:  # gone meanwhile: its time is in its parent's children_* now
            pass
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):  # microseconds, not ticks
        used = resource.getrusage(who)
        total += used.ru_utime + used.ru_stime
    return total


def loader(system: str, where: str, workers: int, batch: int) -> Any:
    if system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(where, shuffle=True)
        return StreamingDataLoader(ds, batch_size=batch, num_workers=workers)
    import shardloader as sl

    raw = sl.RawCollate()
    ds = sl.ShardedDataset(where, batch_size=batch, shuffle=True, decoder=None, collate_fn=raw)
    return sl.make_loader(ds, num_workers=workers)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One epoch in this fresh process; imports happen before the clock, as in a training script."""
    import torch.utils.data  # noqa: F401

    system = spec["system"]
    field = FIELD[(system.split("-")[0], spec["corpus"])]
    if system == "litdata":
        import litdata  # noqa: F401
    else:
        import shardloader.dataset  # noqa: F401
        import shardloader.deliver.loader  # noqa: F401
    import multiprocessing

    load, start_method = os.getloadavg()[0], multiprocessing.get_start_method()
    t0 = time.perf_counter()
    it = iter(loader(system, spec["where"], spec["workers"], spec["batch"]))
    first = next(it)
    t1, cpu1 = time.perf_counter(), tree_cpu()
    n0 = _real(first, field)
    del first
    n = nbytes = 0
    for batch in it:
        n += _real(batch, field)
        nbytes += sum(len(b) for b in batch[field])
    t2, cpu2 = time.perf_counter(), tree_cpu()
    return {
        **spec,
        "samples": n0 + n,
        "samples_s": n / (t2 - t1),
        "mb_s": nbytes / (t2 - t1) / 1e6,
        "cpu_us": (cpu2 - cpu1) / max(n, 1) * 1e6,
        "first_batch_s": t1 - t0,
        "load": load,
        "start_method": start_method,  # what the DataLoader's workers get by default
    }


def _real(batch: Any, field: str) -> int:
    """Samples in a batch, without shardloader's padding (``__pad__``: the last batches of an
    epoch are filled up to equal steps with repeats, which are not counted)."""
    pad = batch.get("__pad__") if isinstance(batch, dict) else None
    return len(batch[field]) - (int(pad.sum()) if pad is not None else 0)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{spec['system']} {spec['corpus']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------ main


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["corpus"], r["workers"], r["system"]), []).append(r)
    keys = ("samples_s", "mb_s", "cpu_us", "first_batch_s", "load")
    return [
        {"corpus": c, "workers": w, "system": s, "runs": len(rs)}
        | {k: statistics.median(r[k] for r in rs) for k in keys}
        for (c, w, s), rs in groups.items()
    ]


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| corpus | workers | system | samples/s | vs LitData | CPU µs/sample (process tree) "
        "| CPU vs LitData | MB/s | first batch (s) | load |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lit = [x for x in rows if x["system"] == "litdata" and x["corpus"] == r["corpus"]]
        lit = [x for x in lit if x["workers"] == r["workers"]]
        speed = f"{r['samples_s'] / lit[0]['samples_s']:.2f}x" if lit else "-"
        # LitData's CPU per sample over ours: above 1, shardloader spends less
        cpu = f"{lit[0]['cpu_us'] / r['cpu_us']:.2f}x" if lit and r["cpu_us"] else "-"
        out.append(
            f"| {r['corpus']} | {r['workers']} | {r['system']} | {r['samples_s']:,.0f} | {speed} "
            f"| {r['cpu_us']:.1f} | {cpu} | {r['mb_s']:,.0f} | {r['first_batch_s']:.3f} "
            f"| {r['load']:.1f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--docs", type=int, default=200000)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="0: build the corpus only")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--work", default="bench-out/peers")
    ap.add_argument("--json", help="write every run and the medians here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        os._exit(0)  # a peer's leftover threads must not hold the exit up
    work = os.path.abspath(args.work)
    os.environ.setdefault("SHARDLOADER_CACHE_DIR", os.path.join(work, "cache"))
    t0 = time.perf_counter()
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    build(work, args.images, args.docs, systems)
    print(f"corpus ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if not args.repeat:
        return
    specs = [
        {"system": s, "corpus": c, "workers": int(w), "batch": args.batch}
        | {"where": os.path.join(work, c, s)}
        for c in ("images", "docs")
        for w in args.workers.split(",")
        for s in systems
    ]
    for spec in specs:
        if spec["workers"] == max(x["workers"] for x in specs):
            run(spec)  # warm-up, not measured: page cache, node cache, compiled modules
    runs = []
    for rep in range(args.repeat):
        shift = rep * len(specs) // args.repeat
        for spec in specs[shift:] + specs[:shift]:
            r = run(spec)
            runs.append(r)
            print(
                f"rep {rep} {r['corpus']:6s} workers={r['workers']} {r['system']:18s} "
                f"{r['samples_s']:10,.0f}/s cpu {r['cpu_us']:.1f} us load {r['load']:.1f}",
                file=sys.stderr,
            )
    rows = medians(runs)
    loads = [r["load"] for r in runs]
    print(
        f"{len(runs)} runs, a fresh process each; medians of {args.repeat}; batch {args.batch}; "
        f"{args.images:,} images, {args.docs:,} documents; {os.cpu_count()} cores, load "
        f"{min(loads):.1f}..{max(loads):.1f}\n"
    )
    print(table(rows))
    if args.json:
        write_figures(args.json, __file__, {"rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
