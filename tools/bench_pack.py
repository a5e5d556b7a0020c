#!/usr/bin/env python
"""Pack the same generated corpus with shardloader and with peer writers; compare input MB/s.

    python tools/bench_pack.py [--corpus DIR] [--images 20000] [--docs 200000] [--repeat 1]
                               [--out DIR] [--only images,text] [--skip litdata,...]

Workloads: ``images`` (class folders of JPEGs) and ``text`` (JSONL documents), from
tools/make_corpus.py (reused when DIR/corpus.json matches the sizes).  Writers, each packing the
whole workload into ~64 MiB shards (uncompressed) from the same warm page cache:

  shardloader        ``pack`` with zstd, ``--workers 1`` and ``--workers 2``
  webdataset         ``ShardWriter`` tar, and tar.zst through its ``opener`` hook (zstd level 3)
  mds                MosaicML streaming ``MDSWriter`` with zstd (if importable)
  litdata            LitData ``optimize`` with zstd, one worker (if importable)

Peers run single-process, as their usual single-writer path.  Imports (and shardloader's
worker forkserver start) happen before the clock starts; everything else is timed.  Reported:
median seconds over ``--repeat`` runs, input MB/s (input bytes / wall seconds), input MB per
CPU-second of the writer's processes (stable on a busy machine), the 1-minute load average when
the run started, stored MB
(everything the writer leaves, indexes included), compression ratio (input / stored), and each
speed relative to the fastest zstd peer.  Benchmark-only extras:
``pip install mosaicml-streaming litdata``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHARD = 64 << 20  # every writer's shard/chunk limit (MDS's default)
ZSTD_LEVEL = 3


# -- inputs ---------------------------------------------------------------------------------


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


def input_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def output_bytes(root: str) -> int:
    return input_bytes(root)


def cpu_seconds() -> float:
    """CPU time of this process and all its descendants, live or reaped (pack workers are
    grandchildren, reaped by the forkserver).  Unlike wall time, it barely depends on what
    else the machine runs."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += c.user + c.system + c.children_user + c.children_system
    return total


def warm(root: str) -> None:
    for d, _, fs in os.walk(root):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass


# -- writers --------------------------------------------------------------------------------


def run_shardloader(workers: int) -> Callable[[str, str, str], None]:
    def run(kind: str, src: str, out: str) -> None:
        from shardloader.pack import PackOptions, pack

        pack(src, out, PackOptions(compression="zstd", workers=workers, shard_size=SHARD))

    return run


def run_webdataset(zstd: bool) -> Callable[[str, str, str], None]:
    def run(kind: str, src: str, out: str) -> None:
        import webdataset as wds
        import zstandard

        os.makedirs(out, exist_ok=True)
        streams: dict[str, object] = {}

        def opener(fname: str):  # noqa: ANN202
            f = open(fname, "wb")  # noqa: SIM115 - closed in post()
            w = zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(f)
            streams[fname] = w
            return w

        def post(fname: str) -> None:
            streams.pop(fname).close()  # type: ignore[attr-defined]

        pattern = os.path.join(out, "shard-%05d.tar" + (".zst" if zstd else ""))
        kw = dict(opener=opener, post=post) if zstd else {}
        with wds.ShardWriter(pattern, maxsize=SHARD, maxcount=10**9, verbose=0, **kw) as sink:
            if kind == "images":
                for key, data, cls in image_items(src):
                    sink.write({"__key__": key, "jpg": data, "cls": cls})
            else:
                for key, line in text_items(src):
                    sink.write({"__key__": key, "json": line})

    return run


def _import_mds():  # noqa: ANN202
    import types

    # MDSWriter needs none of streaming's dataset subpackages; stubbing them keeps a broken
    # torchvision (or transformers) in the environment from failing the import.
    for name in ("streaming.vision", "streaming.multimodal", "streaming.text"):
        sys.modules.setdefault(name, types.ModuleType(name))
    from streaming.base import MDSWriter

    return MDSWriter


def run_mds(kind: str, src: str, out: str) -> None:
    mds_writer = _import_mds()
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


def run_litdata(kind: str, src: str, out: str) -> None:
    import litdata

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
        num_workers=1,
        verbose=False,
        mode="overwrite",
        start_method="spawn",
    )


WRITERS: list[tuple[str, str, Callable[[str, str, str], None], bool]] = [
    # (name, config, run, is_peer_with_zstd)
    ("shardloader", "zstd, --workers 1", run_shardloader(1), False),
    ("shardloader", "zstd, --workers 2", run_shardloader(2), False),
    ("webdataset", "tar (no compression)", run_webdataset(False), False),
    ("webdataset", "tar.zst (opener)", run_webdataset(True), True),
    ("mds", "MDSWriter zstd:3", run_mds, True),
    ("litdata", "optimize zstd, 1 worker", run_litdata, True),
]


def available(name: str) -> str | None:
    """None if the writer can run here (its imports done, outside the timing), else why not."""
    try:
        if name == "mds":
            _import_mds()
        elif name == "litdata":
            import litdata  # noqa: F401
        elif name == "webdataset":
            import webdataset  # noqa: F401
        elif name == "shardloader":
            import pyarrow as pa

            import shardloader.pack  # noqa: F401

            pa.array([0])  # pyarrow's first array imports pandas: a one-time cost, not throughput
    except Exception as err:  # any import failure means "not available"
        return f"{type(err).__name__}: {err}"
    return None


def start_pack_workers(tmp: str) -> float:
    """Start the pack forkserver once (as a long-running packer would) and return its cost."""
    from shardloader.pack import PackOptions, pack

    src = os.path.join(tmp, "warm-src")
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "x.txt"), "w") as f:
        f.write("warm\n")
    start = time.perf_counter()
    pack(src, os.path.join(tmp, "warm-out"), PackOptions(workers=2, overwrite=True))
    return time.perf_counter() - start


# -- driver ---------------------------------------------------------------------------------


def ensure_corpus(path: str, images: int, docs: int, seed: int) -> dict:
    from make_corpus import make_corpus

    meta = os.path.join(path, "corpus.json")
    if os.path.exists(meta):
        with open(meta) as f:
            params = json.load(f)
        if (params.get("images"), params.get("docs"), params.get("seed"), params.get("mixed")) == (
            images,
            docs,
            seed,
            False,
        ):
            return params
        shutil.rmtree(path)
    print(f"generating corpus in {path} ({images} images, {docs} docs) ...", file=sys.stderr)
    # JPEGs only: the figures in README compare writers on the same RGB JPEGs
    return make_corpus(path, images=images, docs=docs, seed=seed, mixed=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--corpus", default="bench-out/corpus")
    p.add_argument("--out", default="bench-out/packed")
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--docs", type=int, default=200000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--only", default="images,text", help="workloads to run")
    p.add_argument(
        "--skip", default="", help="writers to skip (shardloader, webdataset, mds, litdata)"
    )
    p.add_argument("--json", dest="json_out", default=None, help="also write results here")
    a = p.parse_args(argv)

    ensure_corpus(a.corpus, a.images, a.docs, a.seed)
    workloads = {"images": os.path.join(a.corpus, "images"), "text": os.path.join(a.corpus, "docs")}
    skip = {s for s in a.skip.split(",") if s}
    results = []
    if "shardloader" not in skip and available("shardloader") is None:
        startup = start_pack_workers(a.out)
        print(
            f"shardloader: starting the worker forkserver took {startup:.1f} s (once per "
            "process, not in the timings below)",
            file=sys.stderr,
        )
    for kind in [k for k in a.only.split(",") if k]:
        src = workloads[kind]
        size = input_bytes(src)
        warm(src)
        for name, config, run, peer in WRITERS:
            if name in skip:
                continue
            why = available(name)
            if why is not None:
                print(f"{kind}: {name} skipped ({why})", file=sys.stderr)
                continue
            times, cpus, loads, stored = [], [], [], 0
            for _ in range(a.repeat):
                out = os.path.join(a.out, f"{kind}-{name}-{len(results)}")
                shutil.rmtree(out, ignore_errors=True)
                loads.append(os.getloadavg()[0])
                cpu, start = cpu_seconds(), time.perf_counter()
                run(kind, src, out)
                times.append(time.perf_counter() - start)
                cpus.append(cpu_seconds() - cpu)
                stored = output_bytes(out)
                shutil.rmtree(out, ignore_errors=True)
            secs, cpu = statistics.median(times), statistics.median(cpus)
            results.append(
                {
                    "workload": kind,
                    "writer": name,
                    "config": config,
                    "peer_zstd": peer,
                    "input_mb": size / 1e6,
                    "seconds": secs,
                    "mb_s": size / 1e6 / secs,
                    "cpu_s": cpu,
                    "mb_per_cpu_s": size / 1e6 / cpu if cpu else 0.0,
                    "load": statistics.median(loads),
                    "stored_mb": stored / 1e6,
                    "ratio": size / stored if stored else 0,
                }
            )
            print(f"{kind}: {name} {config}: {secs:.1f} s, {cpu:.1f} CPU s", file=sys.stderr)
    print_table(results)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def print_table(results: list[dict]) -> None:
    head = (
        f"{'workload':<8} {'writer':<12} {'config':<24} {'in MB':>7} {'s':>6} {'MB/s':>6} "
        f"{'MB/CPUs':>7} {'load':>4} {'out MB':>7} {'ratio':>6} {'vs best zstd peer':>30}"
    )
    print(head)
    print("-" * len(head))
    for kind in dict.fromkeys(r["workload"] for r in results):
        rows = [r for r in results if r["workload"] == kind]
        peers = [r for r in rows if r["peer_zstd"]]
        best = max(peers, key=lambda r: r["mb_s"]) if peers else None
        for r in rows:
            rel = (
                f"{r['mb_s'] / best['mb_s']:.2f}x speed, ratio {r['ratio'] / best['ratio']:.2f}x"
                if best
                else "-"
            )
            print(
                f"{kind:<8} {r['writer']:<12} {r['config']:<24} {r['input_mb']:>7.1f} "
                f"{r['seconds']:>6.2f} {r['mb_s']:>6.1f} {r['mb_per_cpu_s']:>7.1f} "
                f"{r['load']:>4.1f} {r['stored_mb']:>7.1f} {r['ratio']:>6.3f} {rel:>30}"
            )


if __name__ == "__main__":
    sys.exit(main())
