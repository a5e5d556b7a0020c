#!/usr/bin/env python
"""Pack the same corpus with ``shardloader pack`` and with peer writers, each a fresh process.

    python tools/bench_pack.py [--corpus DIR] [--images 10000] [--docs 200000] [--repeat 3]
                               [--workers 2] [--only images,text] [--skip litdata,...]
                               [--baseline NAME=PATH] [--out DIR] [--json FILE]

What a user runs, from a cold process: every run is a new process started by this script and
timed from its start to its exit (interpreter start, imports, worker start-up and the pack
itself), on a warm page cache.  Runs are interleaved (writer after writer, repeat after repeat,
the order rotated each repeat) so a busy machine slows every writer alike; medians are
printed.

  shardloader     the CLI, ``shardloader pack SRC OUT --workers N --shard-size 64MiB --format F
                  -q`` (one row per ``--formats``: tar and arrow), from
                  the PYTHONPATH in force (``--baseline NAME=PATH`` adds the same command run
                  from another checkout, e.g. ``git archive``'d main, as a before/after row)
  mds             MosaicML streaming ``MDSWriter``, zstd:3, one process (its only mode)
  litdata         LitData ``optimize``, zstd, 1 worker and N workers
  webdataset      ``ShardWriter`` (tar) through zstd level 3, one process

Every writer cuts ~64 MiB shards (uncompressed).  Reported per writer: median seconds, input
MB/s (input bytes / wall seconds), CPU seconds of the process and all its descendants (reaped
through a subreaper, so pack and litdata workers count), stored MB (everything the writer
leaves: shards, indexes, manifest), compression ratio (input / stored), speed and ratio
relative to the best peer, and the machine's load average before the first and after the
last run.  The table also gives every writer's MB/s with its start-up excluded: each writer's
own seconds after its imports, from the same run (start-up included or excluded for every
writer alike; zstd level 3 for all).  Corpus: tools/make_corpus.py, JPEG-only images in class
folders and JSONL documents of lognormal length (reused when DIR/corpus.json matches).  Peers need
``pip install mosaicml-streaming litdata webdataset`` (the bench venv has them); a peer that
cannot be imported is left out with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchjson import write_figures  # noqa: E402
from cputree import reap_orphans, subreaper  # noqa: E402

SHARD = 64 << 20  # every writer's shard/chunk limit (MDS's default)
ZSTD_LEVEL = 3


# -- inputs (what the peers read, in the same order a packer reads) ---------------------------


def image_items(root: str) -> Iterator[tuple[str, bytes, int]]:
    """(key, jpeg bytes, class index) in sorted order, read from disk as a packer must."""
    classes = sorted(os.listdir(root))
    for c, name in enumerate(classes):
        for fname in sorted(os.listdir(os.path.join(root, name))):
            with open(os.path.join(root, name, fname), "rb") as f:
                yield f"{name}/{fname.split('.')[0]}", f.read(), c


def text_items(root: str) -> Iterator[tuple[str, bytes]]:
    for fname in sorted(os.listdir(root)):
        stem = fname.split(".")[0]
        with open(os.path.join(root, fname), "rb") as f:
            for n, line in enumerate(f, start=1):
                line = line.rstrip(b"\n")
                if line:
                    yield f"{stem}/{n:09d}", line


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def warm(root: str) -> None:
    for d, _, fs in os.walk(root):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass


# -- peers: each runs in its own fresh process (``--peer NAME KIND SRC OUT``) -----------------


_AFTER_IMPORTS: list[float] = []  # when a peer's imports were done (its start-up over)


def _imported() -> None:
    _AFTER_IMPORTS.append(time.perf_counter())


def peer_webdataset(kind: str, src: str, out: str, workers: int) -> None:
    import webdataset as wds
    import zstandard

    _imported()

    os.makedirs(out, exist_ok=True)
    streams: dict[str, object] = {}

    def opener(fname: str):  # noqa: ANN202
        f = open(fname, "wb")  # noqa: SIM115 - closed in post()
        w = zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(f)
        streams[fname] = w
        return w

    def post(fname: str) -> None:
        streams.pop(fname).close()  # type: ignore[attr-defined]

    pattern = os.path.join(out, "shard-%05d.tar.zst")
    with wds.ShardWriter(
        pattern, maxsize=SHARD, maxcount=10**9, verbose=0, opener=opener, post=post
    ) as sink:
        if kind == "images":
            for key, data, cls in image_items(src):
                sink.write({"__key__": key, "jpg": data, "cls": cls})
        else:
            for key, line in text_items(src):
                sink.write({"__key__": key, "json": line})


def _import_mds():  # noqa: ANN202
    import types

    # MDSWriter needs none of streaming's dataset subpackages; stubbing them keeps a broken
    # torchvision (or transformers) in the environment from failing the import.
    for name in ("streaming.vision", "streaming.multimodal", "streaming.text"):
        sys.modules.setdefault(name, types.ModuleType(name))
    from streaming.base import MDSWriter

    return MDSWriter


def peer_mds(kind: str, src: str, out: str, workers: int) -> None:
    mds_writer = _import_mds()
    _imported()
    columns = {"jpg": "bytes", "cls": "int"} if kind == "images" else {"json": "bytes"}
    with mds_writer(
        out=out, columns=columns, compression=f"zstd:{ZSTD_LEVEL}", size_limit=SHARD
    ) as w:
        if kind == "images":
            for _, data, cls in image_items(src):
                w.write({"jpg": data, "cls": cls})
        else:
            for _, line in text_items(src):
                w.write({"json": line})


def _litdata_image(path: str) -> dict:
    with open(path, "rb") as f:
        return {"jpg": f.read(), "cls": int(path.rsplit("/", 2)[-2].split("-")[-1])}


def _litdata_text(path: str) -> Iterator[dict]:
    with open(path, "rb") as f:
        for line in f:
            line = line.rstrip(b"\n")
            if line:
                yield {"json": line}


def peer_litdata(kind: str, src: str, out: str, workers: int) -> None:
    import litdata

    _imported()

    if kind == "images":
        inputs = sorted(os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs)
        fn: Callable = _litdata_image
    else:
        inputs = sorted(os.path.join(src, f) for f in os.listdir(src))
        fn = _litdata_text
    litdata.optimize(
        fn=fn,
        inputs=inputs,
        output_dir=out,
        chunk_bytes=SHARD,
        compression="zstd",
        num_workers=workers,
        verbose=False,
        mode="overwrite",
        start_method="spawn",
    )


PEERS: dict[str, Callable[[str, str, str, int], None]] = {
    "mds": peer_mds,
    "litdata": peer_litdata,
    "webdataset": peer_webdataset,
}
PEER_IMPORTS = {"mds": "streaming", "litdata": "litdata", "webdataset": "webdataset"}


# -- the runs -------------------------------------------------------------------------------


@dataclass
class Writer:
    name: str
    config: str
    command: Callable[[str, str, str], list[str]]  # (kind, src, out) -> argv
    env: dict[str, str] = field(default_factory=dict)
    peer: bool = False


def shardloader_writer(name: str, workers: int, path: str | None, fmt: str = "tar") -> Writer:
    exe = os.path.join(os.path.dirname(sys.executable), "shardloader")
    base = [exe] if os.path.exists(exe) else [sys.executable, "-m", "shardloader"]

    def command(kind: str, src: str, out: str) -> list[str]:
        argv = [*base, "pack", src, out, "--workers", str(workers), "--shard-size", "64MiB"]
        return [*argv, "--format", fmt]  # not -q: its report says pack()'s own seconds

    env = {"PYTHONPATH": path} if path else {}
    return Writer(name, f"CLI, {fmt}, zstd, --workers {workers}", command, env)


def peer_writer(name: str, config: str, workers: int) -> Writer:
    def command(kind: str, src: str, out: str) -> list[str]:
        return [sys.executable, __file__, "--peer", name, kind, src, out, str(workers)]

    return Writer(name, config, command, peer=True)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


_PACK_TIME = re.compile(rb"^\s*time\s+([0-9.]+) s,", re.M)  # shardloader pack's report
_PEER_TIME = re.compile(rb"^after imports ([0-9.]+) s$", re.M)


def run_once(w: Writer, kind: str, src: str, out: str) -> tuple[float, float, float | None]:
    """(wall seconds, CPU seconds, seconds after the writer's imports) of one fresh-process
    run; raises if it fails.  After imports: what the writer reports itself (``pack``'s
    summary line, 0.1 s steps; a peer's time from its imports done to its exit)."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    env = {**os.environ, **w.env}
    cpu0 = _children_cpu()
    start = time.perf_counter()
    # cwd: not this checkout, whose shardloader/ a child's '' sys.path entry would pick up
    proc = subprocess.Popen(
        w.command(kind, src, out),
        env=env,
        cwd=os.path.dirname(out),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    output, _ = proc.communicate()
    wall = time.perf_counter() - start
    reap_orphans(time.monotonic() + 10)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{w.name} ({w.config}) on {kind} exited {proc.returncode}:\n"
            + output.decode(errors="replace")[-3000:]
        )
    found = _PACK_TIME.search(output) or _PEER_TIME.search(output)
    return wall, _children_cpu() - cpu0, float(found.group(1)) if found else None


def available(w: Writer) -> str | None:
    if not w.peer:
        return None
    module = PEER_IMPORTS[w.name]
    code = f"import {module}" if w.name != "mds" else "import streaming.base"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return None if r.returncode == 0 else r.stderr.strip().splitlines()[-1]


def ensure_corpus(path: str, images: int, docs: int, seed: int) -> None:
    from make_corpus import make_corpus

    meta = os.path.join(path, "corpus.json")
    if os.path.exists(meta):
        with open(meta) as f:
            params = json.load(f)
        want = (images, docs, seed, False)
        if (
            params.get("images"),
            params.get("docs"),
            params.get("seed"),
            params.get("mixed"),
        ) == want:
            return
        shutil.rmtree(path)
    print(f"generating corpus in {path} ({images} images, {docs} docs) ...", file=sys.stderr)
    make_corpus(path, images=images, docs=docs, seed=seed, mixed=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--peer"]:
        name, kind, src, out, workers = argv[1:6]
        PEERS[name](kind, src, out, int(workers))
        print(f"after imports {time.perf_counter() - _AFTER_IMPORTS[0]:.3f} s", flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--corpus", default="bench-out/corpus")
    p.add_argument("--out", default="bench-out/packed")
    p.add_argument("--images", type=int, default=10000)
    p.add_argument("--docs", type=int, default=200000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--only", default="images,text", help="workloads to run")
    p.add_argument(
        "--formats",
        default="tar,arrow",
        help="shardloader's --format for its rows (tar: a 512-byte header a sample, which "
        "short documents feel; arrow: columns)",
    )
    p.add_argument("--skip", default="", help="writers to skip (mds, litdata, webdataset)")
    p.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also run shardloader from the checkout at PATH (PYTHONPATH), labelled NAME",
    )
    p.add_argument("--json", dest="json_out", default=None, help="also write results here")
    a = p.parse_args(argv)

    a.corpus, a.out = os.path.abspath(a.corpus), os.path.abspath(a.out)
    ensure_corpus(a.corpus, a.images, a.docs, a.seed)
    workloads = {"images": os.path.join(a.corpus, "images"), "text": os.path.join(a.corpus, "docs")}
    skip = {s for s in a.skip.split(",") if s}
    formats = [f for f in a.formats.split(",") if f]
    writers = [shardloader_writer("shardloader", a.workers, None, f) for f in formats]
    for spec in a.baseline:
        name, _, path = spec.partition("=")
        writers += [
            shardloader_writer(f"shardloader ({name})", a.workers, os.path.abspath(path), f)
            for f in formats
        ]
    writers += [
        peer_writer("mds", "MDSWriter zstd:3, 1 process", 1),
        peer_writer("litdata", "optimize zstd, 1 worker", 1),
        peer_writer("litdata", f"optimize zstd, {a.workers} workers", a.workers),
        peer_writer("webdataset", "ShardWriter + zstd:3", 1),
    ]
    writers = [w for w in writers if w.name not in skip]
    for w in list(writers):
        why = available(w)
        if why is not None:
            print(f"{w.name} left out ({why})", file=sys.stderr)
            writers.remove(w)
    reaping = subreaper()
    if not reaping:
        print("no subreaper: CPU seconds leave out orphaned worker processes", file=sys.stderr)
    load_before = os.getloadavg()
    results = []
    for kind in [k for k in a.only.split(",") if k]:
        src = workloads[kind]
        size = tree_bytes(src)
        warm(src)
        walls: dict[int, list[float]] = {i: [] for i in range(len(writers))}
        cpus: dict[int, list[float]] = {i: [] for i in range(len(writers))}
        starts: dict[int, list[float]] = {i: [] for i in range(len(writers))}
        stored: dict[int, int] = {}
        for r in range(a.repeat):
            order = list(range(len(writers)))
            order = order[r % len(order) :] + order[: r % len(order)]
            for i in order:
                w = writers[i]
                out = os.path.join(a.out, f"{kind}-{i}")
                wall, cpu, after = run_once(w, kind, src, out)
                walls[i].append(wall)
                if after is not None:
                    starts[i].append(after)
                cpus[i].append(cpu)
                stored[i] = tree_bytes(out)
                shutil.rmtree(out, ignore_errors=True)
                print(
                    f"{kind} #{r}: {w.name} ({w.config}) {wall:.2f} s, {cpu:.2f} CPU s",
                    file=sys.stderr,
                )
        for i, w in enumerate(writers):
            secs = statistics.median(walls[i])
            after = statistics.median(starts[i]) if len(starts[i]) == len(walls[i]) else None
            results.append(
                {
                    "workload": kind,
                    "writer": w.name,
                    "config": w.config,
                    "peer": w.peer,
                    "input_mb": size / 1e6,
                    "seconds": secs,
                    "mb_s": size / 1e6 / secs,
                    "after_imports_s": after,
                    "mb_s_after_startup": size / 1e6 / after if after else None,
                    "cpu_s": statistics.median(cpus[i]),
                    "stored_mb": stored[i] / 1e6,
                    "ratio": size / stored[i] if stored[i] else 0.0,
                    "runs": walls[i],
                }
            )
    load_after = os.getloadavg()
    print(markdown(results, a, load_before, load_after))
    if a.json_out:
        load = {"before": load_before, "after": load_after}
        write_figures(a.json_out, __file__, {"rows": results, "load": load})
    return 0


def markdown(results: list[dict], a: argparse.Namespace, before: tuple, after: tuple) -> str:
    lines = [
        f"Fresh process per run, median of {a.repeat}, {os.cpu_count()} CPUs; load average "
        f"(1/5/15 min) before {before[0]:.2f}/{before[1]:.2f}/{before[2]:.2f}, after "
        f"{after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f}.",
        "",
        "| work | writer | config | s | input MB/s | CPU s | CPU ms per input MB | stored MB | "
        "ratio | speed vs best peer | CPU vs best peer | ratio vs best peer | s after imports | "
        "MB/s, start-up excluded | vs best peer, start-up excluded |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in dict.fromkeys(r["workload"] for r in results):
        rows = [r for r in results if r["workload"] == kind]
        peers = [r for r in rows if r["peer"]]
        best = max(peers, key=lambda r: r["mb_s"]) if peers else None
        for r in rows:
            speed = f"{r['mb_s'] / best['mb_s']:.2f}x" if best else "-"
            ratio = f"{r['ratio'] / best['ratio']:.3f}x" if best else "-"
            per_mb = r["cpu_s"] / r["input_mb"] * 1e3
            # the best peer's CPU per MB over ours: above 1, we spend less
            cpu = f"{best['cpu_s'] / r['cpu_s']:.2f}x" if best and r["cpu_s"] else "-"
            bare, best_bare = r.get("mb_s_after_startup"), (best or {}).get("mb_s_after_startup")
            lines.append(
                f"| {kind} ({r['input_mb']:.0f} MB) | {r['writer']} | {r['config']} | "
                f"{r['seconds']:.2f} | {r['mb_s']:.1f} | {r['cpu_s']:.2f} | {per_mb:.1f} | "
                f"{r['stored_mb']:.1f} | {r['ratio']:.3f} | {speed} | {cpu} | {ratio} | "
                + (f"{r['after_imports_s']:.2f}" if r.get("after_imports_s") else "-")
                + " | "
                + (f"{bare:.1f}" if bare else "-")
                + " | "
                + (f"{bare / best_bare:.2f}x" if bare and best_bare else "-")
                + " |"
            )
    lines.append("")
    lines.append("Best peer: the fastest peer row of each workload (speed and ratio are its).")
    lines.append(
        "After imports: the seconds each writer reports itself from the end of its imports to "
        "its end (shardloader: pack()'s own time in its summary, pool start-up included; a "
        "peer: from its imports done to its exit); 'start-up excluded' divides the input by "
        "it, for every writer alike."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
