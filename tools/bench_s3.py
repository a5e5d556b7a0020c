"""Object storage at wire speed: S3 and HTTP epochs against local disk, a bare
client, LitData and (optionally) an older shardloader, side by side in one run.

One command:

    python tools/bench_s3.py [--mb 200] [--repeat 3] [--workers 2] [--baseline DIR]

Writes ``--mb`` of incompressible JPEG-like samples into zstd tar shards on local disk, starts
a moto S3 server and a plain static HTTP server (``python -m http.server``), both on 127.0.0.1
and nothing else reachable, and uploads the shards.  Then, interleaved, ``--repeat`` times each
(a fresh process and a cold cache every time, construction timed too):

- one epoch, ``--workers`` DataLoader workers, batch ``--batch``, raw samples, from local disk,
  S3 and HTTP, for each shardloader tree (this one: ``now``; ``--baseline DIR``, a folder holding
  another ``shardloader`` package: ``today``);
- LitData (where installed) on the same samples, local and S3;
- a bare client loop as the server's ceiling: boto3 ``get_object`` of every shard;
- the first batch of a ``--ttfb-shards``-shard manifest on S3, stream order and shuffled;
- ``shardloader pack`` of a folder of files to local disk and to ``s3://`` (input MB/s): the CLI
  a user runs, a fresh process timed from its start to its exit, as an independent check
  times it (``--pack-mb 240 --pack-shard-size 16MiB`` by default), local and s3 interleaved.
  Earlier this row timed ``pack()`` inside an already started interpreter at 100 MB; under the
  same load both measures agree (0.41 and 0.40-0.51 s3/local at load 5-9 on 2 CPUs): the
  0.79 it once printed was a quieter machine, where moto's ingest (its CPU on the same cores,
  about 4 ms per MB, and ~64 MB/s a connection) weighs less.

Requests are counted from the servers' own logs; CPU seconds of the client (the measuring
process and its DataLoader workers) and of the server are read from the kernel, which helps
on a shared machine: wall times move with the load, CPU times much less.  Medians are printed
as Markdown tables with the machine's load average; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any
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

BUCKET = "bench"
MB = 1e6
TOOL = os.path.abspath(__file__)
_ACCESS_RE = re.compile(r'"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/[\d.]+"')
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


# -- servers ----------------------------------------------------------------------------------


class Server:
    """A server subprocess on 127.0.0.1 whose log lists its requests."""

    def __init__(self, argv: list[str], log_path: str, port_re: bytes, cwd: str | None = None):
        self.argv, self.log_path, self.port_re, self.cwd = argv, log_path, port_re, cwd
        self.endpoint = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child keeps the descriptor
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.cwd,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv} exited early:\n{self._text()}")
            m = re.search(self.port_re, self._text().encode())
            if m:
                self.endpoint = f"http://127.0.0.1:{int(m.group(1))}"
                return self
            time.sleep(0.05)
        self.__exit__()
        raise RuntimeError(f"{self.argv} did not report its port within 60 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

    def _text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def mark(self) -> int:
        return os.path.getsize(self.log_path)

    def requests_since(self, mark: int) -> list[tuple[str, str]]:
        time.sleep(0.2)  # servers log after they answered
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            text = _ANSI_RE.sub("", f.read().decode(errors="replace"))
        return [(m.group(1), m.group(2)) for m in _ACCESS_RE.finditer(text)]

    def cpu(self) -> float:
        """CPU seconds the server has used (user + system)."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def moto(root: str) -> Server:
    return Server(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
        os.path.join(root, "moto.log"),
        rb"Running on http://127\.0\.0\.1:(\d+)",
    )


def static_http(root: str, folder: str) -> Server:
    """``python -m http.server``: threaded, no Range support, the plainest static server."""
    return Server(
        [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", folder],
        os.path.join(root, "http.log"),
        rb"Serving HTTP on 127\.0\.0\.1 port (\d+)",
    )


def boto3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", config=Config(max_pool_connections=16)
    )


def upload(s3: Any, folder: str, prefix: str, names: Sequence[str], threads: int = 4) -> None:
    def put(name: str) -> None:
        s3.upload_file(os.path.join(folder, name), BUCKET, f"{prefix}/{name}")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, names))


def classify(requests: list[tuple[str, str]]) -> Counter[str]:
    """Requests by kind: ``GET shard``, ``HEAD sidecar``, ``LIST``, ``GET manifest``, ..."""
    out: Counter[str] = Counter()
    for method, target in requests:
        parts = urlsplit(target)
        path = unquote(parts.path)
        if method == "GET" and ("list-type" in parts.query or path.endswith("/")):
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


# -- data -------------------------------------------------------------------------------------


def jpeg_like(rng: np.random.Generator, size: int) -> bytes:
    """Incompressible bytes framed like a JPEG (SOI/APP0 ... EOI): what a photo costs to ship."""
    return b"\xff\xd8\xff\xe0" + rng.bytes(max(size - 6, 0)) + b"\xff\xd9"


def samples(total: int, sample: int, seed: int = 0) -> Iterator[tuple[str, bytes, int]]:
    rng = np.random.default_rng(seed)
    written = gid = 0
    while written < total:
        size = int(sample * rng.uniform(0.75, 1.25))
        yield f"s/{gid:07d}", jpeg_like(rng, size), gid % 10
        written += size
        gid += 1


def write_shards(out: str, total: int, sample: int, shard: int, seed: int = 0) -> Any:
    """zstd tar shards of ~``shard`` uncompressed bytes, sidecars, manifest (the writer pack
    uses, so shards carry what pack's do)."""
    from synthetic import shard_name, write_manifest, write_shard

    from shardloader.manifest import FieldInfo, Manifest

    os.makedirs(out, exist_ok=True)
    fields = {"jpg": FieldInfo("image"), "cls": FieldInfo("int")}
    shards: list[Any] = []
    items = samples(total, sample, seed)
    pending = next(items, None)

    def one_shard() -> Iterator[tuple[str, dict[str, bytes]]]:
        nonlocal pending
        in_shard = 0
        while pending is not None and in_shard < shard:
            key, data, label = pending
            yield key, {"jpg": data, "cls": str(label).encode()}
            in_shard += len(data)
            pending = next(items, None)

    while pending is not None:
        name = shard_name(len(shards), "tar", "zstd")
        shards.append(write_shard(out, name, "tar", "zstd", fields, one_shard()))
    return write_manifest(out, Manifest("tar", "zstd", fields, shards))


def many_shard_manifest(out: str, shards: int, per_shard: int) -> Any:
    """One real tiny shard listed (and hard-linked) under ``shards`` names: a manifest as large
    as a real one of that many shards, written in a second instead of minutes."""
    from synthetic import listed_again, write_manifest

    from shardloader.manifest import Manifest

    one = write_shards(os.path.join(out, "one"), per_shard * 2000, 2000, per_shard * 2000, 1)
    s = one.shards[0]
    infos = listed_again(s, shards)
    manifest = Manifest(one.format, one.compression, one.fields, infos)
    for info in infos:
        os.link(os.path.join(out, "one", s.path), os.path.join(out, info.path))
        os.link(os.path.join(out, "one", s.index_path), os.path.join(out, info.index_path))
    return write_manifest(out, manifest)


def write_corpus(out: str, total: int, sample: int) -> int:
    """Class folders of JPEG-like files (pack's input); returns their bytes."""
    size = 0
    for key, data, label in samples(total, sample, seed=2):
        folder = os.path.join(out, f"class{label}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, key.split("/")[1] + ".bin"), "wb") as f:
            f.write(data)  # .bin: pack checks a .jpg's markers, and these are only JPEG-like
        size += len(data)
    return size


# -- one measurement, in a fresh process (``--child``) ----------------------------------------


def child_epoch(job: dict[str, Any]) -> dict[str, Any]:
    """One epoch (or ``limit`` batches) through a fresh shardloader loader."""
    import shardloader as sl

    sl.ShardedDataset, sl.make_loader  # noqa: B018 - import torch before the clock starts
    start = time.perf_counter()
    read = sl.ReadOptions(
        storage_options=job["options"],
        readahead=job["readahead"],
        cache=sl.CacheOptions(dir=job["cache"]),
    )
    shuffle = job["shuffle"]
    ds = sl.ShardedDataset(
        job["url"],
        batch_size=job["batch"],
        shuffle=sl.ShuffleOptions(**shuffle) if isinstance(shuffle, dict) else shuffle,
        decoder=None,
        read=read,
        collate_fn=_count_samples,
    )
    built = time.perf_counter() - start  # the fixed cost: client set-up and the manifest GET
    loader = sl.make_loader(ds, num_workers=job["workers"], persistent_workers=False)
    return {**_drain(loader, start, job.get("limit")), "construct": built}


def child_litdata(job: dict[str, Any]) -> dict[str, Any]:
    from litdata import StreamingDataLoader, StreamingDataset

    try:  # LitData's fast path (obstore) refuses plain-http endpoints unless told: allow it
        from litdata.streaming import downloader

        options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
        if isinstance(options, dict):
            downloader._OBSTORE_CLIENT_OPTIONS = {**options, "allow_http": True}
    except ImportError:
        pass

    start = time.perf_counter()
    ds = StreamingDataset(
        job["url"],
        cache_dir=job["cache"] if "://" in job["url"] else None,
        storage_options=job["options"] or None,
        shuffle=job["shuffle"],
    )
    loader = StreamingDataLoader(
        ds, batch_size=job["batch"], num_workers=job["workers"], collate_fn=len
    )
    return _drain(loader, start, job.get("limit"))


def _drain(loader: Any, start: float, limit: int | None) -> dict[str, Any]:
    samples_seen, first = 0, 0.0
    it = iter(loader)
    for i, n in enumerate(it):
        if i == 0:
            first = time.perf_counter() - start
        samples_seen += int(n)
        if limit is not None and i + 1 >= limit:
            break
    del it, loader
    return {"seconds": time.perf_counter() - start, "first": first, "samples": samples_seen}


def _count_samples(batch: list[dict[str, Any]]) -> int:
    """Collate to a count: the bench measures delivery, not the default collate."""
    return sum(not s["__pad__"] for s in batch)


def child_pack(job: dict[str, Any]) -> dict[str, Any]:
    """``shardloader pack`` as a user runs it: a fresh CLI process timed from its start to its
    exit (interpreter, imports, worker start-up, lock, uploads).  Its orphans (the pool's
    forkserver) are re-parented to this process and reaped, so their CPU time is counted."""
    sys.path.insert(0, os.path.dirname(TOOL))
    from cputree import reap_orphans, subreaper

    subreaper()
    argv = [sys.executable, "-m", "shardloader", "pack", job["src"], job["out"]]
    argv += ["--workers", str(job["workers"]), "--shard-size", job["shard_size"], "-q"]
    for key, value in job["options"].items():
        argv += ["-o", f"{key}={value}"]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    reap_orphans(time.monotonic() + 10)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return {"seconds": seconds}


def child_litdata_optimize(job: dict[str, Any]) -> dict[str, Any]:
    from litdata import optimize

    optimize(
        fn=_litdata_sample,
        inputs=[os.path.join(job["src"], p) for p in sorted(job["files"])],
        output_dir=job["out"],
        chunk_bytes=job["chunk_bytes"],
        num_workers=1,
        verbose=False,
    )
    return {}


def _litdata_sample(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        return {"jpg": f.read(), "cls": int(os.path.basename(os.path.dirname(path))[5:])}


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "epoch": child_epoch,
    "litdata": child_litdata,
    "pack": child_pack,
    "litdata-optimize": child_litdata_optimize,
}


def run_child(kind: str, job: dict[str, Any], tree: str | None) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter importing shardloader from ``tree``."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree
    out = subprocess.run(
        [sys.executable, TOOL, "--child", kind, "-"],  # the job on stdin: a list of many
        input=json.dumps(job),  # small samples overflows the argument list
        env=env,
        cwd=tempfile.gettempdir(),  # not a checkout: pack's forkserver puts the cwd on sys.path
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{kind} child failed ({tree}):\n{out.stderr[-4000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def child_main(kind: str, job_text: str) -> None:
    job = json.loads(sys.stdin.read() if job_text == "-" else job_text)
    usage = _cpu()
    result = CHILDREN[kind](job)
    result["cpu"] = _cpu() - usage
    print(json.dumps(result))


def _cpu() -> float:
    """This process and its workers, alive or joined (cputree.py)."""
    sys.path.insert(0, os.path.dirname(TOOL))
    from cputree import tree_cpu

    return tree_cpu()


# -- the run ----------------------------------------------------------------------------------


class Rows:
    """Results by (row name, tree), each a list over repeats."""

    def __init__(self) -> None:
        self.runs: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def add(self, name: str, tree: str, result: dict[str, Any]) -> None:
        self.runs.setdefault((name, tree), []).append(result)

    def median(self, name: str, tree: str, key: str) -> float | None:
        values = [r[key] for r in self.runs.get((name, tree), []) if r.get(key) is not None]
        return statistics.median(values) if values else None

    def requests(self, name: str, tree: str) -> Counter[str]:
        runs = sorted(self.runs.get((name, tree), []), key=lambda r: r.get("seconds", 0.0))
        return Counter(runs[len(runs) // 2].get("requests", {})) if runs else Counter()


def measured(server: Server | None, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()`` with the server's requests and CPU seconds over it added."""
    mark = server.mark() if server is not None else 0
    cpu = server.cpu() if server is not None else 0.0
    result = fn()
    if server is not None:
        result["server_cpu"] = server.cpu() - cpu
        result["requests"] = classify(server.requests_since(mark))
    return result


@contextmanager
def fresh_dir(root: str) -> Iterator[str]:
    path = tempfile.mkdtemp(dir=root, prefix="cache-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=200, help="dataset size in MB (default 200)")
    p.add_argument("--sample-kb", type=float, default=110, help="mean sample size (kB)")
    p.add_argument("--shard-mb", type=float, default=16, help="uncompressed MB per shard")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--readahead", type=int, default=2)
    p.add_argument("--shuffle", action="store_true", help="shuffled epochs (default: stream)")
    p.add_argument("--baseline", default=None, help="folder holding an older shardloader")
    p.add_argument("--ttfb-shards", type=int, default=10_000, help="0 skips time to first batch")
    p.add_argument(
        "--first-block",
        type=int,
        default=256,
        help="also time a shuffled first batch with ShuffleOptions(first_block=N) (0: not)",
    )
    p.add_argument("--pack-mb", type=float, default=240, help="0 skips the pack measurement")
    p.add_argument("--pack-shard-size", default="16MiB", help="pack's --shard-size")
    p.add_argument("--no-litdata", action="store_true")
    p.add_argument(
        "--parts",
        default="epochs,ttfb,pack",
        help="comma-separated subset of epochs, ttfb, pack (default: all)",
    )
    p.add_argument("--workdir", default=None, help="default: a temp folder, removed at the end")
    p.add_argument("--json", default=None, help="also write the epoch rows and every run here")
    p.add_argument("--child", nargs=2, metavar=("KIND", "JOB"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child_main(*args.child)
        return
    root = args.workdir or tempfile.mkdtemp(prefix="bench-s3-")
    os.makedirs(root, exist_ok=True)
    try:
        run(args, root)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def trees(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(label, PYTHONPATH) of each shardloader measured."""
    now = os.path.dirname(os.path.dirname(TOOL))
    out: list[tuple[str, str | None]] = [("now", now)]
    if args.baseline:
        base = os.path.abspath(args.baseline)
        if not os.path.isfile(os.path.join(base, "shardloader", "__init__.py")):
            raise SystemExit(f"--baseline {base}: no shardloader package there")
        out.insert(0, ("today", base))
    return out


def run(args: argparse.Namespace, root: str) -> None:
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    local = os.path.join(root, "ds")
    manifest = write_shards(
        local, int(args.mb * MB), int(args.sample_kb * 1000), int(args.shard_mb * MB)
    )
    stored = sum(s.bytes for s in manifest.shards)
    nshards = len(manifest.shards)
    print(
        f"dataset: {manifest.num_samples:,} samples, {nshards} shards of ~{args.shard_mb:g} MB, "
        f"{stored / MB:.1f} MB stored (zstd tar); {args.workers} workers, batch {args.batch}, "
        f"readahead {args.readahead}, {'shuffled' if args.shuffle else 'stream order'}, "
        f"raw samples, cold cache, a fresh process per run; median of {args.repeat}"
    )
    rows = Rows()
    labels = trees(args)
    litdata = not args.no_litdata and _has("litdata") and "epochs" in args.parts.split(",")
    with moto(root) as s3_server, static_http(root, local) as http_server:
        s3 = boto3_client(s3_server.endpoint)
        s3.create_bucket(Bucket=BUCKET)
        upload(s3, local, "ds", sorted(os.listdir(local)))
        opts = {"endpoint_url": s3_server.endpoint, "key": "testing", "secret": "testing"}
        lit_local = os.path.join(root, "litdata")
        if litdata:
            prepare_litdata(args, root, lit_local, s3)
        keys = [f"ds/{s.path}" for s in manifest.shards]
        s3.get_object(Bucket=BUCKET, Key=keys[0])["Body"].read()  # warm connections

        def bare(threads: int) -> dict[str, Any]:
            start, cpu = time.perf_counter(), os.times()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda k: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read(), keys))
            end = os.times()
            used = end.user - cpu.user + end.system - cpu.system  # this process: the loop's
            return {"seconds": time.perf_counter() - start, "cpu": used}

        def epoch_job(url: str, options: dict[str, Any], cache: str) -> dict[str, Any]:
            return {
                "url": url,
                "options": options,
                "cache": cache,
                "workers": args.workers,
                "batch": args.batch,
                "shuffle": args.shuffle,
                "readahead": args.readahead,
            }

        parts = set(args.parts.split(","))
        for rep in range(args.repeat if "epochs" in parts else 0):
            print(f"repeat {rep + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
            for threads in (2, 4):
                rows.add(
                    f"bare boto3 get_object x{threads}",
                    "-",
                    measured(s3_server, lambda t=threads: bare(t)),
                )
            for label, tree in labels:
                for name, url, options, server in (
                    ("local disk", local, {}, None),
                    ("S3 (moto)", f"s3://{BUCKET}/ds", opts, s3_server),
                    ("HTTP (http.server)", http_server.endpoint, {}, http_server),
                ):
                    with fresh_dir(root) as cache:
                        job = epoch_job(url, options, cache)
                        result = measured(server, lambda j=job, t=tree: run_child("epoch", j, t))
                    rows.add(name, label, result)
            if litdata:
                for name, url, options, server in (
                    ("local disk", lit_local, {}, None),
                    (
                        "S3 (moto)",
                        f"s3://{BUCKET}/litdata",
                        {"endpoint_url": s3_server.endpoint},
                        s3_server,
                    ),
                ):
                    with fresh_dir(root) as cache:
                        job = epoch_job(url, options, cache)
                        result = measured(server, lambda j=job: run_child("litdata", j, None))
                    rows.add(name, "LitData", result)
        load1 = os.getloadavg()
        if "epochs" in parts:
            report_epochs(args, rows, labels, litdata, stored, nshards, manifest.num_samples)
        if args.ttfb_shards and "ttfb" in parts:
            ttfb(args, root, s3_server, s3, rows, labels)
        if args.pack_mb and "pack" in parts:
            pack_rates(args, root, s3_server, rows, labels)
        goals(rows, labels, litdata, stored)
        if args.json:
            write_json(args.json, rows, stored, nshards)
    print(
        f"\nload average (1, 5, 15 min) at start {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}, "
        f"after the epochs {load1[0]:.1f} {load1[1]:.1f} {load1[2]:.1f}; "
        f"{os.cpu_count()} CPUs; total {time.perf_counter() - t0:.0f} s"
    )


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def prepare_litdata(args: argparse.Namespace, root: str, out: str, s3: Any) -> None:
    """The same samples as LitData chunks (its own format, ``optimize``), local and on S3."""
    src = os.path.join(root, "litdata-src")
    for key, data, label in samples(int(args.mb * MB), int(args.sample_kb * 1000)):
        folder = os.path.join(src, f"class{label}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, key.split("/")[1] + ".jpg"), "wb") as f:
            f.write(data)
    files = sorted(
        os.path.relpath(os.path.join(d, n), src) for d, _, ns in os.walk(src) for n in ns
    )
    files.sort(key=lambda p: os.path.basename(p))  # sample order, as the shards have it
    run_child(
        "litdata-optimize",
        {"src": src, "files": files, "out": out, "chunk_bytes": int(args.shard_mb * MB)},
        None,
    )
    shutil.rmtree(src, ignore_errors=True)
    upload(s3, out, "litdata", sorted(os.listdir(out)))


def write_json(path: str, rows: Rows, stored: int, nshards: int) -> None:
    """The epoch table as rows (medians; what tools/plot_benchmarks.py draws), and every run."""
    bare = [rows.median(f"bare boto3 get_object x{t}", "-", "seconds") for t in (2, 4)]
    best = max(stored / MB / s for s in bare if s) if any(bare) else None
    out = []
    for (name, reader), _ in rows.runs.items():
        secs = rows.median(name, reader, "seconds")
        if not secs or name.startswith(("ttfb", "pack")):
            continue
        bare_row = name.startswith("bare")
        local = None if bare_row else rows.median("local disk", reader, "seconds")
        reqs = rows.requests(name, reader)
        shard_reqs = sum(v for k, v in reqs.items() if "manifest" not in k)
        out.append(
            {
                "source": "S3 (moto)" if bare_row else name,
                "reader": name if bare_row else reader,
                "mb_s": stored / MB / secs,
                "vs_local": local / secs if local else None,
                "vs_bare": stored / MB / secs / best if best else None,
                "first_batch_s": rows.median(name, reader, "first"),
                "construct_s": rows.median(name, reader, "construct"),
                "requests_per_shard": shard_reqs / nshards if reqs else None,
            }
        )
    runs = [{"name": n, "reader": r, **run} for (n, r), rs in rows.runs.items() for run in rs]
    sys.path.insert(0, os.path.dirname(TOOL))
    from benchjson import write_figures

    dataset = {"stored_mb": stored / MB, "shards": nshards}
    write_figures(path, TOOL, {"dataset": dataset, "rows": out, "runs": runs})


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _per_mb(rows: Rows, name: str, reader: str, stored: int) -> float | None:
    """CPU ms per stored MB of the client's process tree and the server together (median over
    runs of their sum): the figure other jobs on the machine barely move."""
    runs = rows.runs.get((name, reader), [])
    sums = [r["cpu"] + r.get("server_cpu", 0.0) for r in runs if r.get("cpu") is not None]
    return statistics.median(sums) / (stored / MB) * 1e3 if sums else None


def _after_construction(rows: Rows, name: str, reader: str) -> float | None:
    """The median epoch seconds less the run's own construction (None: not recorded)."""
    rest = [
        r["seconds"] - r["construct"]
        for r in rows.runs.get((name, reader), [])
        if r.get("construct") is not None
    ]
    return statistics.median(rest) if rest else None


def report_epochs(
    args: argparse.Namespace,
    rows: Rows,
    labels: list[tuple[str, str | None]],
    litdata: bool,
    stored: int,
    nshards: int,
    nsamples: int,
) -> None:
    bare = max(
        stored / MB / (rows.median(f"bare boto3 get_object x{t}", "-", "seconds") or 1e9)
        for t in (2, 4)
    )
    print(
        "\n| source | reader | MB/s | samples/s | vs local (same reader) | vs bare boto3 | "
        "1st batch s | construct s | vs local, construction apart | requests / shard | "
        "client CPU s | server CPU s | CPU ms/MB, all |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in (2, 4):
        name = f"bare boto3 get_object x{t}"
        secs = rows.median(name, "-", "seconds")
        print(
            f"| S3 (moto) | {name} | {fmt(stored / MB / secs if secs else None, '.0f')} | - | - | "
            f"{fmt(stored / MB / secs / bare if secs else None)} | - | - | - | 1.0 | "
            f"{fmt(rows.median(name, '-', 'cpu'))} | {fmt(rows.median(name, '-', 'server_cpu'))} "
            f"| {fmt(_per_mb(rows, name, '-', stored))} |"
        )
    readers = [label for label, _ in labels] + (["LitData"] if litdata else [])
    for reader in readers:
        local_secs = rows.median("local disk", reader, "seconds")
        local_rest = _after_construction(rows, "local disk", reader)
        for name in ("local disk", "S3 (moto)", "HTTP (http.server)"):
            secs = rows.median(name, reader, "seconds")
            if secs is None:
                continue
            reqs = rows.requests(name, reader)
            per_shard = (
                f"{sum(v for k, v in reqs.items() if 'manifest' not in k) / nshards:.2f}"
                if reqs
                else "-"
            )
            reader_name = f"shardloader ({reader})" if reader != "LitData" else "LitData"
            print(
                f"| {name} | {reader_name} | {stored / MB / secs:.0f} | {nsamples / secs:,.0f} | "
                f"{fmt(local_secs / secs if local_secs else None)} | "
                f"{fmt(stored / MB / secs / bare)} | {fmt(rows.median(name, reader, 'first'))} | "
                f"{fmt(rows.median(name, reader, 'construct'))} | "
                f"{fmt(_over(local_rest, _after_construction(rows, name, reader)))} | "
                f"{per_shard} | {fmt(rows.median(name, reader, 'cpu'))} | "
                f"{fmt(rows.median(name, reader, 'server_cpu'))} | "
                f"{fmt(_per_mb(rows, name, reader, stored))} |"
            )
    print(
        "\nMB/s: stored MB of the shards / epoch seconds (construction included).  construct s: "
        "the dataset's constructor (for S3: botocore's import and client, the manifest GET), "
        "a fixed cost the epoch includes; the column after it compares the epochs without it.  "
        "requests / "
        "shard: shard + index requests (the manifest apart) per shard per epoch, from the "
        "server's log.  LitData reads its own chunk files written by `optimize` from the same "
        "samples (its MB/s uses the shards' size for comparison)."
    )
    for reader in readers:
        for name in ("S3 (moto)", "HTTP (http.server)"):
            reqs = rows.requests(name, reader)
            if reqs:
                kinds = ", ".join(f"{v} {k}" for k, v in sorted(reqs.items()))
                print(f"- {name}, {reader}: {kinds}")


def ttfb(
    args: argparse.Namespace,
    root: str,
    s3_server: Server,
    s3: Any,
    rows: Rows,
    labels: list[tuple[str, str | None]],
) -> None:
    """Time to the first batch on S3: a manifest of ``--ttfb-shards`` two-sample shards, and the
    epoch dataset (large shards, where a shuffled first batch needs a whole shuffle block).

    Of the many-shard manifest only the manifest and the shards (and sidecars) of the first
    batches are uploaded (moto takes ~10 ms a PUT: 20,000 objects would be minutes); the loader
    stops at its first batch, and any fetch past what was uploaded would fail loudly."""
    from shardloader.plan.order import epoch_order
    from shardloader.plan.shuffle import ShuffleOptions
    from shardloader.plan.split import FixedBatchList
    from shardloader.read.shardset import shard_starts

    folder = os.path.join(root, "many")
    m = many_shard_manifest(folder, args.ttfb_shards, 2)
    starts = shard_starts(m)
    orders: list[tuple[str, Any]] = [("stream", False), ("shuffled", True)]
    if args.first_block:
        fb = {"enabled": True, "first_block": args.first_block}
        orders.append((f"shuffled, first_block={args.first_block}", fb))
    need: set[int] = set()
    for _, shuffle in orders:  # the shards of the first 12 batches, from the pure plan
        opt = ShuffleOptions(**shuffle) if isinstance(shuffle, dict) else ShuffleOptions(shuffle)
        order = epoch_order(m.shard_sizes, 0, 0, opt)
        for b in FixedBatchList(order[: 12 * args.batch], args.batch, "drop"):
            need |= set((np.searchsorted(starts, b, side="right") - 1).tolist())
    names = ["index.json"] + [
        n for i in sorted(need) for n in (m.shards[i].path, m.shards[i].index_path)
    ]
    upload(s3, folder, "many", names)
    kb = os.path.getsize(os.path.join(folder, "index.json")) / 1000
    opts = {"endpoint_url": s3_server.endpoint}
    datasets = (("many", f"{args.ttfb_shards:,} shards of 2 samples"), ("ds", "the epoch dataset"))
    for _ in range(args.repeat):
        for prefix, _title in datasets:
            for label, tree in labels:
                for order_name, shuffle in orders:
                    if isinstance(shuffle, dict) and label != "now":
                        continue  # first_block is new
                    with fresh_dir(root) as cache:
                        job = {
                            "url": f"s3://{BUCKET}/{prefix}",
                            "options": opts,
                            "cache": cache,
                            "workers": args.workers,
                            "batch": args.batch,
                            "shuffle": shuffle,
                            "readahead": args.readahead,
                            "limit": 1,
                        }
                        result = measured(s3_server, lambda j=job, t=tree: run_child("epoch", j, t))
                    rows.add(f"ttfb {prefix} {order_name}", label, result)
    print(
        f"\nTime to the first batch, S3 (moto), {args.workers} workers, batch {args.batch}, "
        f"readahead {args.readahead}; construction included; median of {args.repeat}; the "
        f"many-shard manifest is {kb:,.0f} kB\n"
    )
    print("| dataset | order | reader | 1st batch s | requests until closed | by kind |")
    print("|---|---|---|---:|---:|---|")
    for prefix, title in datasets:
        for order_name, _ in orders:
            for label, _ in labels:
                name = f"ttfb {prefix} {order_name}"
                if (name, label) not in rows.runs:
                    continue
                reqs = rows.requests(name, label)
                kinds = ", ".join(f"{v} {k}" for k, v in sorted(reqs.items()))
                print(
                    f"| {title} | {order_name} | shardloader ({label}) | "
                    f"{fmt(rows.median(name, label, 'first'))} | {sum(reqs.values())} | {kinds} |"
                )


def pack_rates(
    args: argparse.Namespace,
    root: str,
    s3_server: Server,
    rows: Rows,
    labels: list[tuple[str, str | None]],
) -> None:
    """``shardloader pack`` (the CLI, a fresh process each run) of a folder of JPEG-like files
    to local disk and to s3:// (input MB/s), interleaved: local, s3, local, s3, ..."""
    src = os.path.join(root, "corpus")
    size = write_corpus(src, int(args.pack_mb * MB), int(args.sample_kb * 1000))
    opts = {"endpoint_url": s3_server.endpoint}
    load0 = os.getloadavg()
    for rep in range(args.repeat):
        for label, tree in labels:
            for name, out, options, server in (
                ("pack to local disk", os.path.join(root, f"packed-{label}-{rep}"), {}, None),
                ("pack to s3://", f"s3://{BUCKET}/packed-{label}-{rep}", opts, s3_server),
            ):
                job = {
                    "src": src,
                    "out": out,
                    "options": options,
                    "workers": args.workers,
                    "shard_size": args.pack_shard_size,
                }
                result = measured(server, lambda j=job, t=tree: run_child("pack", j, t))
                rows.add(name, label, result)
                print(
                    f"{name} ({label}) #{rep}: {result['seconds']:.2f} s, client CPU "
                    f"{result['cpu']:.2f} s, server CPU {result.get('server_cpu', 0.0):.2f} s",
                    file=sys.stderr,
                )
                if "://" not in out:
                    shutil.rmtree(out, ignore_errors=True)
    load1 = os.getloadavg()
    print(
        f"\n`shardloader pack SRC OUT --workers {args.workers} --shard-size "
        f"{args.pack_shard_size} -q` of {size / MB:.0f} MB of JPEG-like files (class folders) "
        f"into zstd tar shards, a fresh CLI process per run timed from its start to its exit, "
        f"local and s3 interleaved; median of {args.repeat}; load average (1 min) "
        f"{load0[0]:.2f} before, {load1[0]:.2f} after\n"
    )
    print(
        "| reader | pack to local disk, input MB/s | pack to s3://, input MB/s | s3 / local | "
        "CPU ms per input MB, local / s3 client / s3 server |"
    )
    print("|---|---:|---:|---:|---:|")
    for label, _ in labels:
        loc = rows.median("pack to local disk", label, "seconds")
        rem = rows.median("pack to s3://", label, "seconds")
        per_mb = [
            rows.median(n, label, k)
            for n, k in (
                ("pack to local disk", "cpu"),
                ("pack to s3://", "cpu"),
                ("pack to s3://", "server_cpu"),
            )
        ]
        print(
            f"| shardloader ({label}) | {fmt(size / MB / loc if loc else None, '.0f')} | "
            f"{fmt(size / MB / rem if rem else None, '.0f')} | "
            f"{fmt(loc / rem if loc and rem else None)} | "
            + " / ".join(
                fmt(c / (size / MB) * 1e3 if c is not None else None, ".1f") for c in per_mb
            )
            + " |"
        )
    rows.add("pack size", "-", {"bytes": size})


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def goals(rows: Rows, labels: list[tuple[str, str | None]], litdata: bool, stored: int) -> None:
    """The issue's goal table: each measure for each reader, and the goal."""
    bare = max(
        stored / MB / (rows.median(f"bare boto3 get_object x{t}", "-", "seconds") or 1e9)
        for t in (2, 4)
    )

    def ratio(a: str, b: str, label: str) -> float | None:
        x, y = rows.median(a, label, "seconds"), rows.median(b, label, "seconds")
        return y / x if x and y else None

    def per_shard(label: str) -> str:
        reqs = rows.requests("S3 (moto)", label)
        shards = reqs.get("GET shard", 0) or 1
        return f"{sum(v for k, v in reqs.items() if 'manifest' not in k) / shards:.2f}"

    measures: list[tuple[str, Callable[[str], str], str]] = [
        (
            "S3 epoch / local-disk epoch",
            lambda lb: fmt(ratio("S3 (moto)", "local disk", lb)),
            ">= 0.8",
        ),
        (
            "S3 epoch MB/s / bare boto3 GET MB/s",
            lambda lb: fmt(
                stored / MB / s / bare if (s := rows.median("S3 (moto)", lb, "seconds")) else None
            ),
            ">= 0.6",
        ),
        ("requests per shard per epoch (shard + index)", per_shard, "<= 1.1"),
        (
            "first batch, shuffled, 10,000-shard manifest on S3 (s)",
            lambda lb: fmt(rows.median("ttfb many shuffled", lb, "first")),
            "< 1",
        ),
        (
            "pack to s3:// / pack to local disk (input MB/s)",
            lambda lb: fmt(ratio("pack to s3://", "pack to local disk", lb)),
            ">= 0.8",
        ),
        (
            "HTTP epoch / local-disk epoch",
            lambda lb: fmt(ratio("HTTP (http.server)", "local disk", lb)),
            ">= 0.8",
        ),
    ]
    if litdata:
        measures.insert(
            0,
            (
                "S3 epoch / LitData's S3 epoch (samples/s; CPU ms/MB, client + server, "
                "LitData's over ours)",
                lambda lb: (
                    f"{fmt(_over(rows.median('S3 (moto)', 'LitData', 'seconds'), rows.median('S3 (moto)', lb, 'seconds')))}; "  # noqa: E501
                    f"{fmt(_over(_per_mb(rows, 'S3 (moto)', 'LitData', stored), _per_mb(rows, 'S3 (moto)', lb, stored)))}"  # noqa: E501
                ),
                ">= 1.2",
            ),
        )
    names = [label for label, _ in labels]
    print("\nGoals\n")
    print("| measure | " + " | ".join(f"shardloader ({n})" for n in names) + " | LitData | goal |")
    print("|---|" + "---:|" * (len(names) + 2))
    for title, get, goal in measures:
        lit = "-"
        if litdata and title.startswith("S3 epoch /") and "LitData" not in title:
            lit = get("LitData")
        print(f"| {title} | " + " | ".join(get(n) for n in names) + f" | {lit} | {goal} |")


if __name__ == "__main__":
    main()
