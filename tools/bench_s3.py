"""Reading from S3 vs local disk vs a bare client, against a moto server on 127.0.0.1.

Writes ``--mb`` of incompressible JPEG-like samples into shards on local disk, starts a moto S3
server (a subprocess on 127.0.0.1, dummy credentials, nothing else reachable) and uploads them.
Then, each ``--repeat`` times with a cold cache, one epoch of raw samples (``decoder=None``)
through ``make_loader(num_workers=--workers)``, batch ``--batch``:

- from local disk (shards staged = decompressed into the cache, as a compressed pack is);
- from S3 with each ``--readahead`` value;
- a bare client as the "what the server can serve" reference: boto3 ``get_object`` of every
  shard object in a thread pool of each ``--bare-threads`` size;
- time to the first batch on a ``--ttfb-shards``-shard manifest (tiny shards), local and S3,
  in stream order and shuffled.

Requests are counted from the server's own access log, so nothing sits between the client
and the server.  Prints medians and the ratio of S3 to the best bare client.  The machine is
whatever it is (here: shared, 2 cores, moto and the loader competing for them): compare rows of
one run, not runs of different days.

    python tools/bench_s3.py [--mb 200] [--repeat 3] [--readahead 0 2 4] [--workers 2]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import numpy as np

# Loopback only, before anything imports botocore: dummy credentials, no metadata service, no
# profile or config files, no proxies.
_LOOPBACK_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
_UNSET = (
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
)
os.environ.update(_LOOPBACK_ENV)
for _name in _UNSET:
    os.environ.pop(_name, None)

from shardloader import CacheOptions, ReadOptions, ShardedDataset, make_loader  # noqa: E402
from shardloader.format import open_writer, shard_suffix  # noqa: E402
from shardloader.manifest import FieldInfo, Manifest, ShardInfo  # noqa: E402
from shardloader.shards import shard_starts  # noqa: E402
from shardloader.shuffle import ShuffleOptions, epoch_order  # noqa: E402
from shardloader.split import cut_fixed_batches  # noqa: E402

BUCKET = "bench"
MB = 1e6
_PORT_RE = re.compile(rb"Running on http://127\.0\.0\.1:(\d+)")
_ACCESS_RE = re.compile(r'"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/[\d.]+"')
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours some lines


# -- the server -------------------------------------------------------------------------------


class Moto:
    """``python -m moto.server`` on 127.0.0.1; its access log counts the requests."""

    def __init__(self, workdir: str) -> None:
        self.log_path = os.path.join(workdir, "moto.log")
        self.endpoint = ""
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Moto:
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child keeps the descriptor
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto exited early:\n{self._text()}")
            m = _PORT_RE.search(self._text().encode())
            if m:
                self.endpoint = f"http://127.0.0.1:{int(m.group(1))}"
                return self
            time.sleep(0.05)
        self.__exit__()
        raise RuntimeError("moto did not report its port within 60 s")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
            self._proc = None

    def _text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def mark(self) -> int:
        return os.path.getsize(self.log_path)

    def requests_since(self, mark: int) -> list[tuple[str, str]]:
        """(method, path) of every request logged after ``mark``."""
        time.sleep(0.2)  # the server logs after it has answered
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            text = _ANSI_RE.sub("", f.read().decode(errors="replace"))
        return [(m.group(1), m.group(2)) for m in _ACCESS_RE.finditer(text)]


def client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", config=Config(max_pool_connections=16)
    )


def upload(s3: Any, folder: str, prefix: str, names: list[str], threads: int = 4) -> float:
    """Upload ``names`` from ``folder``; returns seconds."""
    start = time.perf_counter()

    def put(name: str) -> None:
        s3.upload_file(os.path.join(folder, name), BUCKET, f"{prefix}/{name}")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, names))
    return time.perf_counter() - start


# -- data -------------------------------------------------------------------------------------


def jpeg_like(rng: np.random.Generator, size: int) -> bytes:
    """Incompressible bytes framed like a JPEG (SOI/APP0 ... EOI): what a photo costs to ship."""
    return b"\xff\xd8\xff\xe0" + rng.bytes(max(size - 6, 0)) + b"\xff\xd9"


def write_shards(
    out: str, total: int, sample: int, shard: int, compression: str, seed: int = 0
) -> Manifest:
    """Shards of ~``shard`` uncompressed bytes holding ~``total`` bytes of samples."""
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    fields = {"jpg": FieldInfo("image"), "cls": FieldInfo("int")}
    shards: list[ShardInfo] = []
    written_bytes = gid = 0
    while written_bytes < total:
        n = len(shards)
        name = f"shard-{n:05d}{shard_suffix('tar', compression)}"
        with open(os.path.join(out, name), "wb") as f:
            writer = open_writer("tar", f, compression, fields)
            in_shard = 0
            while in_shard < shard and written_bytes < total:
                size = int(sample * rng.uniform(0.75, 1.25))
                writer.add(
                    f"s/{gid:07d}", {"jpg": jpeg_like(rng, size), "cls": str(gid % 10).encode()}
                )
                in_shard += size
                written_bytes += size
                gid += 1
            w = writer.close()
        shards.append(_sidecar(out, n, name, w))
    manifest = Manifest("tar", compression, fields, shards)
    with open(os.path.join(out, "index.json"), "wb") as f:
        f.write(manifest.to_json())
    return manifest


def _sidecar(out: str, n: int, name: str, w: Any) -> ShardInfo:
    index_name = f"shard-{n:05d}.idx.arrow"
    data = w.index.to_arrow_bytes()
    with open(os.path.join(out, index_name), "wb") as f:
        f.write(data)
    return ShardInfo(
        name,
        w.num_samples,
        w.bytes,
        w.raw_bytes,
        w.sha256,
        index_name,
        hashlib.sha256(data).hexdigest(),
    )


def many_shard_manifest(out: str, shards: int, per_shard: int, compression: str) -> Manifest:
    """One real tiny shard, listed (and hard-linked) under ``shards`` names: a manifest as large
    as a real one of that many shards, written in a second instead of minutes."""
    one = write_shards(
        os.path.join(out, "one"), per_shard * 2000, 2000, per_shard * 2000, compression, seed=1
    )
    s = one.shards[0]
    suffix = s.path[len("shard-00000") :]
    infos = [
        ShardInfo(
            f"shard-{i:05d}{suffix}",
            s.num_samples,
            s.bytes,
            s.raw_bytes,
            s.sha256,
            f"shard-{i:05d}.idx.arrow",
            s.index_sha256,
        )
        for i in range(shards)
    ]
    manifest = Manifest(one.format, one.compression, one.fields, infos)
    for info in infos:
        os.link(os.path.join(out, "one", s.path), os.path.join(out, info.path))
        os.link(os.path.join(out, "one", s.index_path), os.path.join(out, info.index_path))
    with open(os.path.join(out, "index.json"), "wb") as f:
        f.write(manifest.to_json())
    return manifest


# -- measurements -----------------------------------------------------------------------------


@dataclass
class Epoch:
    seconds: float
    first_batch: float
    samples: int
    requests: list[tuple[str, str]]


def epoch(
    url: str,
    read: ReadOptions,
    workers: int,
    batch: int,
    shuffle: bool,
    moto: Moto | None,
    limit: int | None = None,
) -> Epoch:
    """One epoch (or ``limit`` batches) through a fresh loader; construction is timed too."""
    mark = moto.mark() if moto is not None else 0
    start = time.perf_counter()
    ds = ShardedDataset(
        url, batch_size=batch, shuffle=shuffle, decoder=None, read=read, collate_fn=_count_samples
    )
    loader = make_loader(
        ds, num_workers=workers, persistent_workers=False, prefetch_factor=2 if limit else 4
    )
    samples, first = 0, 0.0
    it = cast(Generator[int, None, None], iter(loader))  # ShardLoader.__iter__ is one
    for i, n in enumerate(it):
        if i == 0:
            first = time.perf_counter() - start
        samples += n
        if limit is not None and i + 1 >= limit:
            break
    it.close()
    del loader, it
    seconds = time.perf_counter() - start
    reqs = moto.requests_since(mark) if moto is not None else []
    return Epoch(seconds, first, samples, reqs)


def _count_samples(samples: list[dict[str, Any]]) -> int:
    """Collate to a count: the bench measures delivery, not the default collate."""
    return sum(not s["__pad__"] for s in samples)


def bare(get: Callable[[str], Any], keys: list[str], threads: int) -> float:
    """Seconds to ``get`` every key, ``threads`` at a time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, keys))
    return time.perf_counter() - start


def _fetch_part(endpoint: str, infos: list[ShardInfo], folder: str) -> None:
    from shardloader.storage.fetch import fetch_shard

    for s in infos:
        fetch_shard(
            f"s3://{BUCKET}/ds/{s.path}",
            os.path.join(folder, s.path),
            sha256=s.sha256,
            size=s.bytes,
            storage_options={"endpoint_url": endpoint},
        )


def fetch_in_processes(endpoint: str, manifest: Manifest, procs: int, root: str) -> float:
    """Seconds for ``procs`` new processes to download every shard with ``fetch_shard``."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")  # as DataLoader workers start
    with fresh_dir(root) as folder:
        start = time.perf_counter()
        jobs = [
            ctx.Process(
                target=_fetch_part, args=(endpoint, list(manifest.shards[i::procs]), folder)
            )
            for i in range(procs)
        ]
        for j in jobs:
            j.start()
        for j in jobs:
            j.join()
        if any(j.exitcode != 0 for j in jobs):
            raise RuntimeError("a fetch_shard process failed")
        return time.perf_counter() - start


def classify(requests: list[tuple[str, str]]) -> Counter[str]:
    """Requests by kind: ``GET shard``, ``HEAD sidecar``, ``LIST``, ``GET manifest``, ..."""
    out: Counter[str] = Counter()
    for method, target in requests:
        parts = urlsplit(target)
        path = unquote(parts.path)
        if method == "GET" and ("list-type" in parts.query or path.rstrip("/").count("/") < 2):
            out["LIST"] += 1
        elif path.endswith(".idx.arrow"):
            out[f"{method} sidecar"] += 1
        elif path.endswith("index.json"):
            out[f"{method} manifest"] += 1
        elif "/shard-" in path:
            out[f"{method} shard"] += 1
        else:
            out[f"{method} other"] += 1
    return out


@contextmanager
def fresh_dir(root: str) -> Iterator[str]:
    path = tempfile.mkdtemp(dir=root, prefix="cache-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def median_of(repeat: int, fn: Callable[[], Epoch]) -> tuple[Epoch, list[Epoch]]:
    runs = [fn() for _ in range(repeat)]
    order = sorted(runs, key=lambda e: e.seconds)
    return order[len(order) // 2], runs


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=200, help="dataset size in MB (default 200)")
    p.add_argument("--sample-kb", type=float, default=110, help="mean sample size (kB)")
    p.add_argument("--shard-mb", type=float, default=16, help="uncompressed MB per shard")
    p.add_argument("--compression", choices=("zstd", "gzip", "none"), default="zstd")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--readahead", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--shuffle", action="store_true", help="shuffled epochs (default: stream)")
    p.add_argument("--bare-threads", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ttfb-shards", type=int, default=10_000, help="0 skips time to first batch")
    p.add_argument("--ttfb-samples", type=int, default=2, help="samples per tiny shard")
    p.add_argument("--workdir", default=None, help="default: a temp folder, removed at the end")
    args = p.parse_args(argv)

    root = args.workdir or tempfile.mkdtemp(prefix="bench-s3-")
    os.makedirs(root, exist_ok=True)
    try:
        run(args, root)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: str) -> None:
    t0 = time.perf_counter()
    local = os.path.join(root, "ds")
    manifest = write_shards(
        local,
        int(args.mb * MB),
        int(args.sample_kb * 1000),
        int(args.shard_mb * MB),
        args.compression,
    )
    stored = sum(s.bytes for s in manifest.shards)
    nshards = len(manifest.shards)
    print(
        f"dataset: {manifest.num_samples:,} samples, {nshards} shards, {stored / MB:.1f} MB "
        f"stored ({args.compression}), written in {time.perf_counter() - t0:.1f} s"
    )
    loader_kind = "shuffled" if args.shuffle else "stream order"
    rows: list[tuple[str, ...]] = []
    with Moto(root) as moto:
        s3 = client(moto.endpoint)
        s3.create_bucket(Bucket=BUCKET)
        names = sorted(os.listdir(local))
        secs = upload(s3, local, "ds", names)
        print(f"server: moto at {moto.endpoint}; upload {stored / MB / secs:.0f} MB/s (4 threads)")
        storage = {"endpoint_url": moto.endpoint, "key": "testing", "secret": "testing"}

        def read(cache: str, readahead: int) -> ReadOptions:
            return ReadOptions(
                storage_options=storage, readahead=readahead, cache=CacheOptions(dir=cache)
            )

        import s3fs

        fs = s3fs.S3FileSystem(
            key="testing", secret="testing", client_kwargs={"endpoint_url": moto.endpoint}
        )
        keys = [f"ds/{s.path}" for s in manifest.shards]
        clients: dict[str, Callable[[str], Any]] = {
            "boto3 get_object": lambda k: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read(),
            "s3fs cat_file": lambda k: fs.cat_file(f"{BUCKET}/{k}"),
        }
        bare_mbs = []
        for name, get in clients.items():
            get(keys[0])  # warm: sessions and connections exist, as in a running job
            for threads in args.bare_threads:
                times = [bare(get, keys, threads) for _ in range(args.repeat)]
                mbs = stored / MB / statistics.median(times)
                bare_mbs.append(mbs)
                rows.append(
                    (
                        f"bare {name} x{threads}",
                        "-",
                        "-",
                        f"{mbs:.0f}",
                        "-",
                        "-",
                        f"{len(keys)}",
                        "1.0",
                        "GET shard",
                    )
                )
        ref = max(bare_mbs)
        # The loader's own download step alone (fetch_shard: ranged GETs, sha256, temp file) in
        # fresh processes, one per worker: what is left after the stack, before staging/reading.
        times = [
            fetch_in_processes(moto.endpoint, manifest, args.workers, root)
            for _ in range(args.repeat)
        ]
        rows.append(
            (
                f"fetch_shard only, {args.workers} fresh procs",
                "-",
                "-",
                f"{stored / MB / statistics.median(times):.0f}",
                f"{stored / MB / statistics.median(times) / ref:.2f}",
                "-",
                "-",
                "-",
                "",
            )
        )

        def add(name: str, ra: str, e: Epoch) -> None:
            kinds = classify(e.requests)
            total = sum(kinds.values())
            mbs = stored / MB / e.seconds
            rows.append(
                (
                    name,
                    ra,
                    f"{e.samples / e.seconds:,.0f}",
                    f"{mbs:.0f}",
                    f"{mbs / ref:.2f}",
                    f"{e.first_batch:.2f}",
                    f"{total}" if e.requests else "-",
                    f"{total / nshards:.1f}" if e.requests else "-",
                    ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())),
                )
            )

        def local_epoch() -> Epoch:
            with fresh_dir(root) as cache:
                return epoch(local, read(cache, 2), args.workers, args.batch, args.shuffle, None)

        add("local disk", "2", median_of(args.repeat, local_epoch)[0])
        for ra in args.readahead:

            def s3_epoch(ra: int = ra) -> Epoch:
                with fresh_dir(root) as cache:
                    return epoch(
                        f"s3://{BUCKET}/ds",
                        read(cache, ra),
                        args.workers,
                        args.batch,
                        args.shuffle,
                        moto,
                    )

            e, runs = median_of(args.repeat, s3_epoch)
            assert all(r.samples == manifest.num_samples for r in runs), "lost samples"
            add("s3 (moto)", str(ra), e)
        elapsed = time.perf_counter() - t0

        print(
            f"\none epoch, {args.workers} workers, batch {args.batch}, raw samples, "
            f"{loader_kind}, cold cache; median of {args.repeat}; MB/s = stored MB / s; "
            f"'vs bare' = MB/s / best bare client ({ref:.0f} MB/s)"
        )
        header = (
            "source",
            "readahead",
            "samples/s",
            "MB/s",
            "vs bare",
            "1st batch s",
            "req/epoch",
            "req/shard",
            "requests",
        )
        print_table(header, rows)
        if args.ttfb_shards:
            ttfb(args, root, moto, s3)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s (epochs {elapsed:.0f} s)")


def ttfb(args: argparse.Namespace, root: str, moto: Moto, s3: Any) -> None:
    """Time to the first batch on a manifest of ``--ttfb-shards`` tiny shards.

    On S3 only the manifest and the shards of the first batches are uploaded (moto takes ~10 ms
    a PUT: 20,000 objects would be minutes); the loader stops at its first batch, and any fetch
    past what was uploaded would fail loudly.
    """
    folder = os.path.join(root, "many")
    t0 = time.perf_counter()
    m = many_shard_manifest(folder, args.ttfb_shards, args.ttfb_samples, args.compression)
    kb = os.path.getsize(os.path.join(folder, "index.json")) / 1000
    starts = shard_starts(m)
    need: set[int] = set()
    for shuffle in (False, True):  # the shards of the first 12 batches, from the pure plan
        order = epoch_order(m.shard_sizes, 0, 0, ShuffleOptions(shuffle))
        batches, _, _ = cut_fixed_batches(order[: 12 * args.batch], args.batch, "drop")
        for b in batches:
            need |= set((np.searchsorted(starts, b, side="right") - 1).tolist())
    names = ["index.json"] + [
        n for i in sorted(need) for n in (m.shards[i].path, m.shards[i].index_path)
    ]
    upload(s3, folder, "many", names)
    print(
        f"\ntime to first batch: {args.ttfb_shards:,} shards of {args.ttfb_samples} samples, "
        f"manifest {kb:,.0f} kB, {args.workers} workers, batch {args.batch}, readahead 2; "
        f"median of {args.repeat} (setup {time.perf_counter() - t0:.0f} s, "
        f"{len(names)} objects uploaded)"
    )
    rows = []
    for where, url in (("local disk", folder), ("s3 (moto)", f"s3://{BUCKET}/many")):
        for shuffle in (False, True):

            def first(url: str = url, shuffle: bool = shuffle, where: str = where) -> Epoch:
                with fresh_dir(root) as cache:
                    opts = ReadOptions(
                        storage_options={"endpoint_url": moto.endpoint},
                        readahead=2,
                        cache=CacheOptions(dir=cache),
                    )
                    return epoch(
                        url,
                        opts,
                        args.workers,
                        args.batch,
                        shuffle,
                        moto if where != "local disk" else None,
                        limit=1,
                    )

            e, _ = median_of(args.repeat, first)
            kinds = classify(e.requests)
            rows.append(
                (
                    where,
                    "shuffled" if shuffle else "stream order",
                    f"{e.first_batch:.2f}",
                    f"{sum(kinds.values())}" if e.requests else "-",
                    ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())),
                )
            )
    print_table(("source", "order", "1st batch s", "req until closed", "by kind"), rows)


def print_table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print(
            "  ".join(
                str(c).ljust(w) if i in (0, len(r) - 1) else str(c).rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )


if __name__ == "__main__":
    main()
