"""Read throughput of shardloader against its peers, on the same data, in one run.

Measures, for raw (undecoded) samples in the page cache: samples/s and MB/s with
``num_workers`` 0 and 2, time to first batch, peak RSS of the whole process tree, shardloader's
resume-at-90% time to first batch, and a shuffle-quality metric on a class-sorted dataset
(shardloader's block shuffle vs webdataset's buffer shuffle holding as many samples).

Peers are measured where installed (benchmark-only; a separate venv is fine):
  pip install litdata mosaicml-streaming datasets

    python tools/bench_read.py --images 20000 --docs 200000 --repeat 3

Medians over ``--repeat`` runs; machines are noisy, so compare ratios within one run.

``--verify-cost`` measures only what the per-sample checksum (XXH3-64) costs (``ReadOptions(
verify_samples=True)`` against ``False``), interleaving on/off runs and taking medians: per
sample in the shard reader alone, and as samples/s through the loader, for zstd-compressed
(staged) and uncompressed (read in place) shards:

    python tools/bench_read.py --verify-cost --images 20000 --docs 200000 --repeat 5
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import shardloader as sl  # noqa: E402
from shardloader.format import open_writer, shard_suffix  # noqa: E402
from shardloader.manifest import FieldInfo, Manifest, ShardInfo  # noqa: E402

# ----------------------------------------------------------------------------------- corpus


def make_images(n: int, seed: int = 0) -> list[tuple[str, bytes, int]]:
    """JPEG-like payloads: incompressible bytes of lognormal size (median ~12 KB), 10 classes,
    class-sorted (as class folders are)."""
    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(np.log(12_000), 0.5, n), 1_000, 200_000).astype(int)
    blob = rng.bytes(int(sizes.max()) + 4096)
    out = []
    for i, size in enumerate(sizes):
        off = int(rng.integers(0, 4096))
        label = i * 10 // n
        out.append(
            (
                f"c{label}/{i:07d}",
                b"\xff\xd8" + blob[off : off + size] + i.to_bytes(4, "little"),
                label,
            )
        )
    return out


def make_docs(n: int, seed: int = 1) -> list[tuple[str, bytes, int]]:
    """JSONL documents with lognormal lengths (median ~1 KB of text)."""
    rng = np.random.default_rng(seed)
    words = [
        w.encode() for w in "the of and to in data loader shard batch worker model train".split()
    ]
    lengths = np.clip(rng.lognormal(np.log(180), 0.9, n), 5, 20_000).astype(int)
    out = []
    for i, length in enumerate(lengths):
        picks = rng.integers(0, len(words), length)
        text = b" ".join(words[p] for p in picks)
        out.append((f"d/{i:08d}", b'{"text": "' + text + b'"}', 0))
    return out


# ----------------------------------------------------------------------------------- writers


def write_shardloader(
    samples, out: str, ext: str, compression: str = "zstd", per_shard: int = 0
) -> None:
    per_shard = per_shard or max(1, len(samples) // 32)
    fields = {ext: FieldInfo("bytes"), "cls": FieldInfo("int")}
    shards = []
    import hashlib

    for n, lo in enumerate(range(0, len(samples), per_shard)):
        name = f"shard-{n:05d}{shard_suffix('tar', compression)}"
        with open(os.path.join(out, name), "wb") as f:
            w = open_writer("tar", f, compression, fields)
            for key, data, label in samples[lo : lo + per_shard]:
                w.add(key, {ext: data, "cls": str(label).encode()})
            ws = w.close()
        idx = ws.index.to_arrow_bytes()
        with open(os.path.join(out, f"shard-{n:05d}.idx.arrow"), "wb") as f:
            f.write(idx)
        shards.append(
            ShardInfo(
                name,
                ws.num_samples,
                ws.bytes,
                ws.raw_bytes,
                ws.sha256,
                f"shard-{n:05d}.idx.arrow",
                hashlib.sha256(idx).hexdigest(),
            )
        )
    with open(os.path.join(out, "index.json"), "wb") as f:
        f.write(Manifest("tar", compression, fields, shards).to_json())


def write_webdataset(samples, out: str, ext: str) -> list[str]:
    import webdataset as wds

    per_shard = max(1, len(samples) // 32)
    with wds.ShardWriter(os.path.join(out, "wds-%05d.tar"), maxcount=per_shard, verbose=0) as sink:
        for key, data, label in samples:
            sink.write({"__key__": key.replace("/", "_"), ext: data, "cls": label})
    return sorted(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".tar"))


def _litdata_item(item):
    return item


def write_litdata(samples, out: str, ext: str) -> None:
    from litdata import optimize

    items = [{"key": k, ext: d, "cls": c} for k, d, c in samples]
    optimize(
        fn=_litdata_item,
        inputs=items,
        output_dir=out,
        chunk_bytes="64MB",
        num_workers=1,
        mode="overwrite",
    )


def _stub_streaming_extras() -> None:
    """streaming's vision/text subpackages import torchvision/transformers, which this
    benchmark neither needs nor can install beside torch 2.13: stub them."""
    import types

    for name in ("streaming.vision", "streaming.multimodal", "streaming.text"):
        sys.modules.setdefault(name, types.ModuleType(name))


def write_mosaic(samples, out: str, ext: str) -> None:
    from streaming.base import MDSWriter

    with MDSWriter(
        out=out,
        columns={"key": "str", ext: "bytes", "cls": "int"},
        compression="zstd",
        size_limit="64mb",
    ) as w:
        for key, data, label in samples:
            w.write({"key": key, ext: data, "cls": label})


def write_hf(samples, out: str, ext: str) -> None:
    import datasets

    ds = datasets.Dataset.from_dict(
        {
            "key": [k for k, _, _ in samples],
            ext: [d for _, d, _ in samples],
            "cls": [c for _, _, c in samples],
        }
    )
    ds.save_to_disk(out)


def write_files(samples, out: str, ext: str) -> list[str]:
    paths = []
    for key, data, _ in samples:
        path = os.path.join(out, f"{key}.{ext}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------------- readers


class FilesDataset:
    """The per-file ImageFolder baseline: one open+read per sample."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        with open(self.paths[i], "rb") as f:
            return {"data": f.read(), "cls": i}


class HFDataset:
    def __init__(self, path: str) -> None:
        import datasets

        self.ds = datasets.load_from_disk(path)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        return self.ds[i]


def _collate_list(batch):
    return batch


def loader_for(system: str, where, ext: str, workers: int, batch: int, read=None):
    from torch.utils.data import DataLoader

    kw = dict(num_workers=workers, persistent_workers=False)
    if workers:
        # the same start method for everyone: an imported peer may switch the default to spawn
        kw["prefetch_factor"] = 4
        kw["multiprocessing_context"] = "fork"
    if system == "shardloader":
        ds = sl.ShardedDataset(
            where,
            batch_size=batch,
            shuffle=True,
            decoder=None,
            collate_fn=_collate_list,
            read=read,
        )
        return sl.make_loader(ds, **kw)
    if system == "webdataset":
        import webdataset as wds

        ds = wds.WebDataset(
            where,
            shardshuffle=False,
            nodesplitter=wds.split_by_node,
            workersplitter=wds.split_by_worker,
            empty_check=False,
        ).batched(batch, collation_fn=_collate_list)
        return DataLoader(ds, batch_size=None, **kw)
    if system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        return StreamingDataLoader(
            StreamingDataset(where, shuffle=True), batch_size=batch, collate_fn=_collate_list, **kw
        )
    if system == "mosaicml":
        from streaming.base import StreamingDataset

        shutil.rmtree(os.path.join(where, "..", "mds-local"), ignore_errors=True)
        ds = StreamingDataset(local=where, shuffle=True, batch_size=batch)
        return DataLoader(ds, batch_size=batch, collate_fn=_collate_list, **kw)
    if system == "hf-datasets":
        return DataLoader(
            HFDataset(where), batch_size=batch, shuffle=True, collate_fn=_collate_list, **kw
        )
    if system == "files":
        return DataLoader(
            FilesDataset(where), batch_size=batch, shuffle=True, collate_fn=_collate_list, **kw
        )
    raise ValueError(system)


# ----------------------------------------------------------------------------------- measuring


class PeakRSS:
    """Samples the RSS of this process and its children every 20 ms."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                for p in [self.proc, *self.proc.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except Exception:  # a worker exiting mid-sample
                        pass
            except Exception:
                pass
            self.peak = max(self.peak, total)
            time.sleep(0.02)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Result:
    system: str
    corpus: str
    workers: int
    samples_s: float
    mb_s: float
    ttfb_s: float
    peak_rss_mb: float
    samples: int


def measure(
    make: Callable[[], Iterable], payload_key: str | None
) -> tuple[float, float, int, int, float]:
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        it = iter(make())
        first = None
        n = nbytes = 0
        for batch in it:
            if first is None:
                first = time.perf_counter() - t0
            n += len(batch)
            for s in batch:
                for k, v in s.items():
                    if isinstance(v, bytes) and not k.startswith("__"):
                        nbytes += len(v)
        elapsed = time.perf_counter() - t0
    return elapsed, first or 0.0, n, nbytes, rss.peak / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--docs", type=int, default=200000)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default="bench-out/read")
    ap.add_argument(
        "--systems", default="shardloader,webdataset,litdata,mosaicml,hf-datasets,files"
    )
    ap.add_argument("--json", help="write results here")
    ap.add_argument(
        "--verify-cost",
        action="store_true",
        help="measure only the per-sample checksum check, on against off",
    )
    args = ap.parse_args()
    if args.verify_cost:
        verify_cost(args)
        return
    workers = [int(w) for w in args.workers.split(",")]
    systems = args.systems.split(",")
    available = []
    for s in systems:
        mod = {"litdata": "litdata", "mosaicml": "streaming.base", "hf-datasets": "datasets"}.get(s)
        if s == "mosaicml":
            _stub_streaming_extras()
        if mod:
            try:
                __import__(mod)
            except ImportError:
                print(f"skip {s}: not installed", file=sys.stderr)
                continue
        available.append(s)

    results: list[Result] = []
    makers = {"images": (make_images, args.images, "jpg"), "docs": (make_docs, args.docs, "json")}
    for corpus, (maker, count, ext) in makers.items():
        if not count:
            continue
        samples = maker(count)
        base = os.path.join(args.work, corpus)
        where = {}
        for system in available:
            if system == "files" and corpus == "docs":
                continue
            out = os.path.join(base, system)
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            t0 = time.perf_counter()
            if system == "shardloader":
                write_shardloader(samples, out, ext)
                where[system] = out
            elif system == "webdataset":
                where[system] = write_webdataset(samples, out, ext)
            elif system == "litdata":
                write_litdata(samples, out, ext)
                where[system] = out
            elif system == "mosaicml":
                write_mosaic(samples, out, ext)
                where[system] = out
            elif system == "hf-datasets":
                write_hf(samples, out, ext)
                where[system] = out
            elif system == "files":
                where[system] = write_files(samples, out, ext)
            print(
                f"wrote {corpus} for {system} in {time.perf_counter() - t0:.1f}s", file=sys.stderr
            )
        # Measure from a lean process: DataLoader workers fork from this one, and a parent
        # holding the whole corpus in Python objects makes every fork (every system's) slower.
        del samples
        gc.collect()
        for w in workers:
            for system in where:
                runs = []
                for _ in range(args.repeat):
                    make = functools.partial(
                        loader_for, system, where[system], ext, w, args.batch_size
                    )
                    runs.append(measure(make, ext))
                el = statistics.median(r[0] for r in runs)
                r0 = runs[0]
                results.append(
                    Result(
                        system,
                        corpus,
                        w,
                        r0[2] / el,
                        r0[3] / el / 1e6,
                        statistics.median(r[1] for r in runs),
                        max(r[4] for r in runs),
                        r0[2],
                    )
                )
                print(
                    f"{corpus:6s} {system:12s} workers={w} {results[-1].samples_s:10.0f} samples/s",
                    file=sys.stderr,
                )
        if "shardloader" in where:
            results_resume = resume_times(where["shardloader"], args.batch_size, args.repeat)
            print(
                f"{corpus}: shardloader time to first batch fresh "
                f"{results_resume[0] * 1e3:.0f} ms, "
                f"resumed at 90% {results_resume[1] * 1e3:.0f} ms"
            )
    print_table(results)
    if args.images:
        print_shuffle_quality(args.images, args.batch_size, os.path.join(args.work, "shuffle"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1)


def _reader_us_per_sample(folder: str, verify: bool) -> float:
    """Time to read every sample of the first shard through the shard reader, per sample."""
    from shardloader.format.tar import TarShardReader
    from shardloader.manifest import SampleIndex

    manifest, _ = sl.read_manifest(folder)
    info = manifest.shards[0]
    with open(os.path.join(folder, info.index_path), "rb") as f:
        index = SampleIndex.from_arrow_bytes(f.read())
    reader = TarShardReader(os.path.join(folder, info.path), index, info.path, verify)
    t0 = time.perf_counter()
    for i in range(len(index)):
        reader.read(i)
    elapsed = time.perf_counter() - t0
    reader.close()
    return elapsed / len(index) * 1e6


def verify_cost(args: argparse.Namespace) -> None:
    """What ReadOptions(verify_samples=True) costs; on/off runs interleaved, medians."""
    workers = [int(w) for w in args.workers.split(",")]
    makers = {"images": (make_images, args.images, "jpg"), "docs": (make_docs, args.docs, "json")}
    rows = []
    for corpus, (maker, count, ext) in makers.items():
        if not count:
            continue
        samples = maker(count)
        mean_kb = sum(len(d) for _, d, _ in samples) / len(samples) / 1e3
        folders = {}
        for compression in ("zstd", "none"):
            out = os.path.join(args.work, "verify-cost", corpus, compression)
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            write_shardloader(samples, out, ext, compression)
            folders[compression] = out
        del samples
        gc.collect()
        on, off = [], []
        for _ in range(max(args.repeat, 3) * 3):
            on.append(_reader_us_per_sample(folders["none"], True))
            off.append(_reader_us_per_sample(folders["none"], False))
        reader = (statistics.median(on), statistics.median(off))
        print(
            f"{corpus} ({mean_kb:.1f} KB/sample) shard reader: {reader[0]:.2f} us/sample "
            f"with the check, {reader[1]:.2f} without: {reader[0] - reader[1]:.2f} us/sample",
            file=sys.stderr,
        )
        for compression, folder in folders.items():
            for w in workers:
                times: dict[bool, list[float]] = {True: [], False: []}
                n = 0
                for rep in range(args.repeat + 1):  # the first round stages and warms up
                    for verify in (True, False) if rep % 2 else (False, True):  # no order bias
                        read = sl.ReadOptions(
                            verify_samples=verify,
                            cache=sl.CacheOptions(dir=os.path.join(args.work, "verify-cache")),
                        )
                        make = functools.partial(
                            loader_for, "shardloader", folder, ext, w, args.batch_size, read
                        )
                        elapsed, _, n, _, _ = measure(make, ext)
                        if rep:
                            times[verify].append(elapsed)
                t_on, t_off = statistics.median(times[True]), statistics.median(times[False])
                rows.append(
                    (corpus, compression, w, n / t_on, n / t_off, (t_on - t_off) / n * 1e6, reader)
                )
                print(
                    f"{corpus} {compression} workers={w}: {n / t_on:,.0f} vs "
                    f"{n / t_off:,.0f} samples/s",
                    file=sys.stderr,
                )
    print(
        "\n| corpus | shards | workers | samples/s check on | off | cost (us/sample) "
        "| reader alone: on / off (us/sample) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for corpus, compression, w, s_on, s_off, cost, reader in rows:
        print(
            f"| {corpus} | {compression} | {w} | {s_on:,.0f} | {s_off:,.0f} | {cost:+.2f} | "
            f"{reader[0]:.2f} / {reader[1]:.2f} |"
        )


def resume_times(path: str, batch: int, repeat: int) -> tuple[float, float]:
    """Median time to the first batch, fresh and resumed at 90 %, measured in a new process
    (peers measured before may leave threads and processes behind in this one)."""
    import subprocess

    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import bench_read; "
        "print(json.dumps(bench_read._resume_times_here(sys.argv[2], int(sys.argv[3]), "
        "int(sys.argv[4]))))"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            os.path.dirname(os.path.abspath(__file__)),
            path,
            str(batch),
            str(repeat),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    fresh, resumed = json.loads(out.stdout.strip().splitlines()[-1])
    return fresh, resumed


def _resume_times_here(path: str, batch: int, repeat: int) -> tuple[float, float]:
    fresh, resumed = [], []
    for _ in range(repeat):
        for target, pos_frac in ((fresh, 0.0), (resumed, 0.9)):
            ds = sl.ShardedDataset(
                path, batch_size=batch, shuffle=True, decoder=None, collate_fn=_collate_list
            )
            loader = sl.make_loader(ds, num_workers=2)
            state = loader.state_dict()
            state["position"] = int(len(ds) * pos_frac)
            loader.load_state_dict(state)
            t0 = time.perf_counter()
            next(iter(loader))
            target.append(time.perf_counter() - t0)
            del loader
    return statistics.median(fresh), statistics.median(resumed)


def print_table(results: list[Result]) -> None:
    print(
        "\n| corpus | system | workers | samples/s | MB/s | first batch (s) | peak RSS (MB) "
        "| vs best peer |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for corpus in dict.fromkeys(r.corpus for r in results):
        for w in dict.fromkeys(r.workers for r in results):
            rows = [r for r in results if r.corpus == corpus and r.workers == w]
            peers = [r.samples_s for r in rows if r.system != "shardloader"]
            best = max(peers) if peers else float("nan")
            for r in sorted(rows, key=lambda r: -r.samples_s):
                print(
                    f"| {corpus} | {r.system} | {w} | {r.samples_s:,.0f} | {r.mb_s:,.0f} | "
                    f"{r.ttfb_s:.2f} | {r.peak_rss_mb:,.0f} | {r.samples_s / best:.2f}x |"
                )


def class_mix(labels_per_batch: list[list[int]]) -> float:
    """Mean number of distinct classes per batch."""
    return float(np.mean([len(set(b)) for b in labels_per_batch]))


def print_shuffle_quality(n: int, batch: int, work: str) -> None:
    """Class-sorted data: distinct classes per batch, vs a true global shuffle."""
    import webdataset as wds

    samples = [(f"c{i * 10 // n}/{i:07d}", b"x", i * 10 // n) for i in range(n)]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "sl"))
    os.makedirs(os.path.join(work, "wds"))
    write_shardloader(samples, os.path.join(work, "sl"), "bin", "none", per_shard=max(1, n // 64))
    urls = write_webdataset(samples, os.path.join(work, "wds"), "bin")
    rng = np.random.default_rng(0)
    perm = np.array([s[2] for s in samples])[rng.permutation(n)]
    ideal = class_mix([perm[i : i + batch].tolist() for i in range(0, n - batch + 1, batch)])
    print(
        f"\nShuffle quality on class-sorted data ({n} samples, 10 classes, batches of {batch}): "
        f"distinct classes per batch (global shuffle = {ideal:.2f})"
    )
    print("| samples held | shardloader block shuffle | webdataset shardshuffle + buffer |")
    print("|---:|---:|---:|")
    for held in (1000, 5000, n):
        ds = sl.ShardedDataset(
            os.path.join(work, "sl"),
            batch_size=batch,
            collate_fn=_collate_list,
            shuffle=sl.ShuffleOptions(True, block=held),
            uneven="drop",
        )
        ours = class_mix([[s["cls"] for s in b] for b in sl.make_loader(ds)])
        pipe = (
            wds.WebDataset(urls, shardshuffle=100, empty_check=False, seed=0)
            .shuffle(held, initial=held)
            .batched(batch, partial=False)
        )
        theirs = class_mix(
            [
                [int(c) for c in b["cls"]] if isinstance(b, dict) else [int(s[1]) for s in b]
                for b in (_labels(x) for x in pipe)
            ]
        )
        print(f"| {held} | {ours:.2f} | {theirs:.2f} |")


def _labels(batch):
    if isinstance(batch, dict):
        return {"cls": batch["cls"]}
    return batch


if __name__ == "__main__":
    main()
