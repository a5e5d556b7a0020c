"""Training-loop throughput reading from ``shardloader serve`` vs a local DataLoader, one machine.

Two workloads, both stored pre-decoded so the pipeline itself is cheap and the transport's
cost shows (the worst case for the service; real decode and augmentation only shrink its
share):

- image: batches of 64 x 3 x 224 x 224 uint8 (9.6 MB), ``.npy`` samples;
- tokens: batches of 64 x 2048 int32 (0.5 MB), ``tokens`` samples.

For each, the same dataset is read by ``make_loader(ds, num_workers=W)`` in this process and
by a :class:`RemoteLoader` from a ``shardloader serve`` subprocess on 127.0.0.1 with ``--workers
W``.  Reported: steady-state batches/s of the loop (first batch excluded; it is reported as
start-up latency), the service's overhead, the time it adds per batch, and the CPU the training
process itself spends per batch (the DataLoader's main-process work vs the client's): medians over
``--runs`` paired runs (local and service alternate, so a shared machine's drifting load hits
both alike).  ``--step-ms`` adds a simulated training step per batch: once the step is longer
than the pipeline, both loaders keep up and the overhead disappears behind it.

    python tools/bench_service.py                 # ~1-2 minutes on 2 cores
    python tools/bench_service.py --runs 5 --batches 40 --workers 4
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import shardloader as sl  # noqa: E402
from shardloader.format import open_writer, shard_suffix  # noqa: E402
from shardloader.manifest import FieldInfo, Manifest, ShardInfo  # noqa: E402
from shardloader.service import RemoteLoader  # noqa: E402

BATCH = 64


@dataclass(frozen=True)
class Workload:
    name: str
    field: str
    info: FieldInfo
    shape: tuple[int, ...]
    dtype: str

    def encode(self, i: int, rng: np.random.Generator) -> bytes:
        if self.info.codec == "npy":
            buf = io.BytesIO()
            np.save(buf, rng.integers(0, 256, self.shape, dtype=np.uint8), allow_pickle=False)
            return buf.getvalue()
        return rng.integers(0, 50_000, self.shape, dtype=np.int32).astype("<i4").tobytes()


WORKLOADS = {
    "image": Workload("image", "npy", FieldInfo("npy"), (3, 224, 224), "uint8"),
    "tokens": Workload("tokens", "tokens", FieldInfo("tokens", "int32"), (2048,), "int32"),
}


def write_dataset(out: str, work: Workload, samples: int, per_shard: int = 256) -> str:
    """An uncompressed tar dataset (read in place: the cheapest local pipeline there is)."""
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(0)
    fields = {work.field: work.info}
    shards = []
    for n, start in enumerate(range(0, samples, per_shard)):
        name = f"shard-{n:05d}{shard_suffix('tar', 'none')}"
        with open(os.path.join(out, name), "wb") as f:
            writer = open_writer("tar", f, "none", fields)
            for i in range(start, min(start + per_shard, samples)):
                writer.add(f"s/{i:07d}", {work.field: work.encode(i, rng)})
            written = writer.close()
        index_name = f"shard-{n:05d}.idx.arrow"
        index = written.index.to_arrow_bytes()
        with open(os.path.join(out, index_name), "wb") as f:
            f.write(index)
        shards.append(
            ShardInfo(
                name,
                written.num_samples,
                written.bytes,
                written.raw_bytes,
                written.sha256,
                index_name,
                hashlib.sha256(index).hexdigest(),
            )
        )
    with open(os.path.join(out, "index.json"), "wb") as f:
        f.write(Manifest("tar", "none", fields, shards).to_json())
    return out


@dataclass
class Run:
    first_s: float  # time to the first batch
    rate: float  # batches/s after the first
    cpu_ms: float  # CPU time of this (the training) process per batch, all its threads
    checked: bool  # the first batch has the expected shape


def consume(loader: object, work: Workload, batches: int, step_s: float) -> Run:
    start = time.perf_counter()
    cpu = time.process_time()
    first = 0.0
    count = 0
    ok = False
    for batch in loader:  # type: ignore[attr-defined]
        if count == 0:
            first = time.perf_counter()
            x = batch[work.field]
            ok = tuple(x.shape) == (BATCH, *work.shape) and str(x.dtype) == f"torch.{work.dtype}"
        if step_s:
            time.sleep(step_s)
        count += 1
        if count == batches:
            break
    end = time.perf_counter()
    cpu = time.process_time() - cpu  # sleeping (the simulated step) costs no CPU
    if count < batches:
        raise SystemExit(f"only {count} batches in the epoch; use more --samples")
    return Run(first - start, (count - 1) / (end - first), cpu / count * 1000, ok)


class Server:
    def __init__(self, data: str, workers: int, workdir: str) -> None:
        port_file = os.path.join(workdir, "port")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardloader",
                "serve",
                data,
                "--batch-size",
                str(BATCH),
                "--workers",
                str(workers),
                "--port",
                "0",
                "--port-file",
                port_file,
                "--max-inflight",
                "4",
                "--log-level",
                "warning",
            ],
            cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"shardloader serve exited with {self.proc.returncode}")
            if os.path.exists(port_file):
                with open(port_file) as f:
                    self.url = f"http://127.0.0.1:{int(f.read())}"
                try:
                    urllib.request.urlopen(f"{self.url}/health", timeout=5).close()
                    return
                except OSError:
                    pass
            time.sleep(0.1)
        raise SystemExit("shardloader serve did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def bench(work: Workload, data: str, args: argparse.Namespace, workdir: str) -> dict[str, float]:
    step_s = args.step_ms / 1000
    os.makedirs(workdir, exist_ok=True)
    cache = sl.CacheOptions(dir=os.path.join(workdir, "cache"))
    ds = sl.ShardedDataset(
        data, batch_size=BATCH, read=sl.ReadOptions(cache=cache), rank=0, world_size=1
    )
    local = sl.make_loader(ds, num_workers=args.workers)
    server = Server(data, args.workers, workdir)
    try:
        remote = RemoteLoader(server.url, rank=0, world_size=1)
        consume(local, work, 2, 0)  # warm the page cache and both pipelines
        consume(remote, work, 2, 0)
        runs: dict[str, list[Run]] = {"local": [], "remote": []}
        for epoch in range(args.runs):  # paired and alternated: drifting load hits both alike
            ds.set_epoch(epoch + 1)
            remote.set_epoch(epoch + 1)
            order = ("local", "remote") if epoch % 2 == 0 else ("remote", "local")
            for name in order:
                loader = local if name == "local" else remote
                runs[name].append(consume(loader, work, args.batches, step_s))
    finally:
        server.stop()
        del local
    if not all(r.checked for rs in runs.values() for r in rs):
        raise SystemExit(f"{work.name}: a batch had the wrong shape or dtype")
    local_rate = statistics.median(r.rate for r in runs["local"])
    remote_rate = statistics.median(r.rate for r in runs["remote"])
    pairs = list(zip(runs["local"], runs["remote"], strict=True))
    return {
        "local": local_rate,
        "remote": remote_rate,
        "overhead": statistics.median(1 - r.rate / lo.rate for lo, r in pairs),
        "per_batch_ms": statistics.median(1 / r.rate - 1 / lo.rate for lo, r in pairs) * 1000,
        "local_first_ms": statistics.median(r.first_s for r in runs["local"]) * 1000,
        "remote_first_ms": statistics.median(r.first_s for r in runs["remote"]) * 1000,
        "local_cpu_ms": statistics.median(r.cpu_ms for r in runs["local"]),
        "remote_cpu_ms": statistics.median(r.cpu_ms for r in runs["remote"]),
        "mb": BATCH * int(np.prod(work.shape)) * np.dtype(work.dtype).itemsize / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    p.add_argument("--batches", type=int, default=16, help="batches timed per run")
    p.add_argument("--runs", type=int, default=5, help="paired runs per loader (median)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (both sides)")
    p.add_argument("--step-ms", type=float, default=0.0, help="simulated training step")
    p.add_argument("--workdir", default=None, help="default: a temporary folder")
    args = p.parse_args(argv)
    if min(args.batches, args.runs) < 2 or args.workers < 0 or args.step_ms < 0:
        p.error("--batches and --runs must be >= 2, --workers and --step-ms >= 0")
    workdir = args.workdir or tempfile.mkdtemp(prefix="shardloader-bench-service-")
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    rows = []
    try:
        for name in names:
            work = WORKLOADS[name]
            data = write_dataset(os.path.join(workdir, name), work, BATCH * (args.batches + 1))
            print(
                f"{name}: {BATCH * (args.batches + 1)} samples written; measuring ...",
                file=sys.stderr,
                flush=True,
            )
            rows.append((work, bench(work, data, args, os.path.join(workdir, name + "-run"))))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\nloopback, {args.workers} DataLoader workers each side, step {args.step_ms:g} ms, "
        f"{args.batches} batches x {args.runs} runs (median), {os.cpu_count()} CPUs\n"
    )
    print(
        "| batches | MB/batch | local batches/s | service batches/s | overhead | "
        "added per batch | trainer CPU per batch local / service | "
        "first batch local / service |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for work, r in rows:
        shape = "x".join(map(str, (BATCH, *work.shape)))
        print(
            f"| {work.name} {shape} {work.dtype} | {r['mb']:.2f} | {r['local']:.1f} | "
            f"{r['remote']:.1f} | {r['overhead']:+.1%} | {r['per_batch_ms']:+.2f} ms | "
            f"{r['local_cpu_ms']:.2f} / {r['remote_cpu_ms']:.2f} ms | "
            f"{r['local_first_ms']:.0f} / {r['remote_first_ms']:.0f} ms |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
