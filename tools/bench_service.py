"""Service overhead: a training loop reading from `shardloader serve` vs the local loader, one host.

One command (~3-5 minutes on 2 busy cores; corpora are generated once and reused)::

    python tools/bench_service.py [--runs 5] [--workers 2] [--workload all] [--transport tcp]

Workloads, each the fastest documented shardloader path for that data, on real-size data:

- ``images``: real-size JPEGs (``tools/make_corpus.py``), ``decoder=None`` +
  ``RawCollate()``, batches of 64 (a :class:`RawBatch`, one buffer per field);
- ``documents``: JSONL documents of lognormal length, ``RawCollate()``, batches of 256;
- ``tokens``: the same documents packed ``--format tokens``, ``TokenBlocks(2048, 8)``: int64
  ``input_ids``/``labels``/``position_ids``/``attention_mask`` [8, 2048] + ``cu_seqlens``.

Shards are uncompressed tar / tokens (read in place: the cheapest local pipeline there is, so
the transport's share is the largest it can be).  For each workload the same dataset (one
factory, :func:`pipeline`) is read by ``make_loader(ds, num_workers=W)`` in this process and by
a :class:`RemoteLoader` from a ``shardloader serve`` subprocess on 127.0.0.1 (``--workers W``),
over TCP (``tcp``: what every client gets).  ``--transport shm`` or ``both`` measure the
same-host shared-memory handover of a shardloader that still has it (run this tool with an
older checkout on PYTHONPATH: the road was measured on a shared 2-core machine and removed,
docs/service.md).  No training step: the worst case.

Reported per workload: steady-state batches/s of the loop (from a quarter of the run to its
end; each stream starts its own DataLoader workers, which shows in the first batch's latency),
the service's overhead ``1 - service rate / local rate``, the time it adds per batch, the CPU per
batch of every process involved over the same stretch (local: this one and its DataLoader
workers; service: this one, the server and its workers; its ratio is the overhead a machine
whose cores are all busy would see, and it depends far less on what else runs there), and the
CPU the training process itself spends per batch.  Runs alternate local and service (a shared
machine's drifting load hits both alike); medians over ``--runs`` pairs.  The machine's load
average is printed before and after.  ``--profile DIR`` writes py-spy raw stack samples of the
server (py-spy must be on PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import shardloader as sl  # noqa: E402
from shardloader.service import RemoteLoader  # noqa: E402

SEQ, ROWS = 2048, 8


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int  # samples (rows for tokens) per batch
    per_run: int  # batches timed per run


WORKLOADS = {
    "images": Workload("images", 64, 110),
    "documents": Workload("documents", 256, 500),
    "tokens": Workload("tokens", ROWS, 2000),
}


# -- the pipeline (also the server's factory: ``bench_service:pipeline``) ----------------------


def pipeline() -> Any:
    """The dataset ``$BENCH_SERVICE_WORKLOAD`` over ``$BENCH_SERVICE_DATA`` (server and local)."""
    work = WORKLOADS[os.environ["BENCH_SERVICE_WORKLOAD"]]
    data = os.environ["BENCH_SERVICE_DATA"]
    cache = sl.CacheOptions(dir=os.environ["BENCH_SERVICE_CACHE"])
    if work.name == "tokens":
        from shardloader.batching import TokenBlocks

        return sl.ShardedDataset(
            data,
            planner=TokenBlocks(SEQ, ROWS, pad_id=0),
            shuffle=True,
            seed=1,
            read=sl.ReadOptions(cache=cache),
        )
    return sl.ShardedDataset(
        data,
        batch_size=work.batch,
        shuffle=True,
        seed=1,
        decoder=None,
        collate_fn=sl.RawCollate(),
        read=sl.ReadOptions(cache=cache),
    )


# -- corpora ------------------------------------------------------------------------------------


def _stamp_ok(path: str, params: dict[str, Any]) -> bool:
    try:
        with open(path) as f:
            return bool(json.load(f) == params)
    except (OSError, ValueError):
        return False


def prepare(work: str, images: int, docs: int) -> dict[str, str]:
    """Packed datasets per workload under ``work``; reused when the parameters match."""
    import make_corpus

    from shardloader.pack import PackOptions, pack

    params = {"images": images, "docs": docs, "version": 2}
    stamp = os.path.join(work, "prepared.json")
    out = {name: os.path.join(work, name) for name in WORKLOADS}
    if _stamp_ok(stamp, params):
        return out
    shutil.rmtree(work, ignore_errors=True)
    raw = os.path.join(work, "raw")
    print(f"generating {images} JPEGs and {docs} documents ...", file=sys.stderr, flush=True)
    make_corpus.make_corpus(
        raw, images=images, classes=10, docs=docs, doc_files=2, jobs=2, mixed=False
    )
    vocab = make_corpus.vocabulary(0)
    tok = os.path.join(work, "tokenizer.json")
    _tokenizer(tok, [str(w) for w in vocab])
    opts = {"compression": "none", "workers": 2, "overwrite": True}
    pack(os.path.join(raw, "images"), out["images"], PackOptions(**opts))  # type: ignore[arg-type]
    pack(os.path.join(raw, "docs"), out["documents"], PackOptions(**opts))  # type: ignore[arg-type]
    pack(
        os.path.join(raw, "docs"),
        out["tokens"],
        PackOptions(format="tokens", tokenizer=tok, **opts),  # type: ignore[arg-type]
    )
    shutil.rmtree(raw, ignore_errors=True)
    with open(stamp, "w") as f:
        json.dump(params, f)
    return out


def _tokenizer(path: str, words: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i + 1 for i, w in enumerate(words)}
    vocab["[UNK]"] = len(vocab) + 1
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.save(path)


# -- measuring ----------------------------------------------------------------------------------


@dataclass
class Run:
    first_s: float  # time to the first batch
    rate: float  # batches/s after the first
    cpu_ms: float  # CPU time of this (the training) process per batch, all its threads
    all_cpu_ms: float = 0.0  # CPU per batch of every process involved (workers, server)


def _tree_cpu(pid: int, skip: int | None = None) -> float:
    """CPU seconds of a process, its live descendants (but ``skip``'s tree) and the children
    it has reaped (a stream's DataLoader workers, once it ended)."""
    import psutil

    total = 0.0
    try:
        proc = psutil.Process(pid)
        t = proc.cpu_times()
        total += t.user + t.system + t.children_user + t.children_system
        skipped = {skip} if skip else set()
        if skip:
            try:
                skipped |= {c.pid for c in psutil.Process(skip).children(recursive=True)}
            except psutil.Error:
                pass
        for child in proc.children(recursive=True):
            if child.pid in skipped:
                continue
            try:
                c = child.cpu_times()
                total += c.user + c.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def measured(loader: Any, batches: int, server: int, remote: bool) -> Run:
    """A run: steady-state rate and CPU from a quarter of the way in to the end (a stream
    starts its own DataLoader workers, whose start shows in the first batch's latency), the CPU
    of every process it uses: this one and its DataLoader workers (local), or this one plus
    the server and its workers (remote)."""

    def cpu() -> float:
        mine = _tree_cpu(os.getpid(), skip=server)
        return mine + _tree_cpu(server) if remote else mine

    return consume(loader, batches, cpu)


def consume(loader: Any, batches: int, cpu: Any = None) -> Run:
    start = time.perf_counter()
    mark = max(1, batches // 4)
    first = steady = 0.0
    own = cpu0 = 0.0
    count = 0
    for _batch in loader:
        count += 1
        if count == 1:
            first = time.perf_counter()
        if count == mark:
            cpu0 = cpu() if cpu is not None else 0.0
            own = time.process_time()
            steady = time.perf_counter()
        if count == batches:
            break
    end = time.perf_counter()
    own = time.process_time() - own
    if count < batches or batches - mark < 1:
        raise SystemExit(f"only {count} batches in the epoch; the corpus is too small")
    n = batches - mark
    run = Run(first - start, n / (end - steady), own / n * 1000)
    if cpu is not None:
        run.all_cpu_ms = (cpu() - cpu0) / n * 1000
    return run


class Server:
    """``shardloader serve bench_service:pipeline`` in a subprocess on 127.0.0.1."""

    def __init__(self, env: dict[str, str], workers: int, workdir: str, profile: str | None):
        port_file = os.path.join(workdir, "port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        cmd = [sys.executable, "-m", "shardloader", "serve", "bench_service:pipeline"]
        cmd += ["--workers", str(workers), "--port", "0", "--port-file", port_file]
        cmd += ["--max-inflight", "4", "--log-level", "warning"]
        if profile:
            name = os.path.join(profile, f"server-{env['BENCH_SERVICE_WORKLOAD']}.txt")
            cmd = ["py-spy", "record", "-s", "-r", "200", "-f", "raw", "-o", name, "--", *cmd]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"shardloader serve exited with {self.proc.returncode}")
            if os.path.exists(port_file):
                with open(port_file) as f:
                    text = f.read()
                if text.strip():
                    self.url = f"http://127.0.0.1:{int(text)}"
                    try:
                        urllib.request.urlopen(f"{self.url}/health", timeout=5).close()
                        return
                    except OSError:
                        pass
            time.sleep(0.1)
        raise SystemExit("shardloader serve did not start")

    def stop(self) -> None:
        self.proc.send_signal(2 if self.proc.args[0] == "py-spy" else 15)
        self.proc.wait(60)


def bench(work: Workload, data: str, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    os.makedirs(workdir, exist_ok=True)
    env = {
        **os.environ,
        "BENCH_SERVICE_WORKLOAD": work.name,
        "BENCH_SERVICE_DATA": data,
        "BENCH_SERVICE_CACHE": os.path.join(workdir, "cache"),
        "PYTHONPATH": os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    os.environ.update({k: env[k] for k in env if k.startswith("BENCH_SERVICE_")})
    ds = pipeline()
    local = sl.make_loader(ds, num_workers=args.workers)
    server = Server(env, args.workers, workdir, args.profile)
    transports = ["shm", "tcp"] if args.transport == "both" else [args.transport]
    try:
        remotes = {t: _remote(server.url, t) for t in transports}
        consume(local, 2)  # warm the page cache and both pipelines
        for remote in remotes.values():
            consume(remote, 2)
        names = ["local", *transports]
        runs: dict[str, list[Run]] = {name: [] for name in names}
        for i in range(args.runs):  # alternated: drifting load hits every loader alike
            ds.set_epoch(i + 1)
            for r in remotes.values():
                r.set_epoch(i + 1)
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                loader = local if name == "local" else remotes[name]
                runs[name].append(measured(loader, work.per_run, server.proc.pid, name != "local"))
    finally:
        server.stop()
        del local
    out: dict[str, Any] = {
        "local": statistics.median(r.rate for r in runs["local"]),
        "local_first_ms": statistics.median(r.first_s for r in runs["local"]) * 1000,
        "local_cpu_ms": statistics.median(r.cpu_ms for r in runs["local"]),
        "local_all_ms": statistics.median(r.all_cpu_ms for r in runs["local"]),
    }
    for t in transports:
        pairs = list(zip(runs["local"], runs[t], strict=True))
        out[t] = {
            "rate": statistics.median(r.rate for r in runs[t]),
            "overhead": statistics.median(1 - r.rate / lo.rate for lo, r in pairs),
            "per_batch_ms": statistics.median(1 / r.rate - 1 / lo.rate for lo, r in pairs) * 1e3,
            "first_ms": statistics.median(r.first_s for r in runs[t]) * 1000,
            "cpu_ms": statistics.median(r.cpu_ms for r in runs[t]),
            "all_ms": statistics.median(r.all_cpu_ms for r in runs[t]),
            "cpu_overhead": statistics.median(r.all_cpu_ms / lo.all_cpu_ms - 1 for lo, r in pairs),
        }
    return out


def _remote(url: str, transport: str) -> RemoteLoader:
    import importlib.util

    if transport == "tcp":
        return RemoteLoader(url, world=sl.World(0, 1))
    if importlib.util.find_spec("shardloader.service.shm") is None:
        raise SystemExit(
            "this shardloader has no shared-memory road (removed, see docs/service.md); use "
            "--transport tcp, or put an older checkout on PYTHONPATH"
        )
    return RemoteLoader(url, world=sl.World(0, 1), transport="auto")


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    p.add_argument("--transport", choices=["shm", "tcp", "both"], default="tcp")
    p.add_argument("--runs", type=int, default=5, help="alternated runs per loader (median)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (both sides)")
    p.add_argument("--images", type=int, default=8000)
    p.add_argument("--docs", type=int, default=160000)
    p.add_argument(
        "--workdir",
        default=os.path.join(tempfile.gettempdir(), "shardloader-bench-service"),
        help="corpora are kept here and reused",
    )
    p.add_argument("--profile", default=None, help="write py-spy samples of the server here")
    args = p.parse_args(argv)
    if args.runs < 2 or args.workers < 0:
        p.error("--runs must be >= 2, --workers >= 0")
    data = prepare(os.path.join(args.workdir, "data"), args.images, args.docs)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    load_before = _load()
    rows = []
    for name in names:
        print(f"{name}: measuring ...", file=sys.stderr, flush=True)
        run_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=args.workdir)
        try:
            rows.append((WORKLOADS[name], bench(WORKLOADS[name], data[name], args, run_dir)))
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    transports = ["shm", "tcp"] if args.transport == "both" else [args.transport]
    print(
        f"\n127.0.0.1, {args.workers} DataLoader workers each side, no training step, "
        f"median of {args.runs} alternated runs, {os.cpu_count()} CPUs, load average "
        f"(1/5/15 min) before {load_before}, after {_load()}\n"
    )
    print(
        "| workload | batch | transport | local batches/s | service batches/s | overhead | "
        "added per batch | CPU per batch, all processes, local / service | CPU overhead | "
        "trainer CPU per batch local / service | first batch local / service |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for work, r in rows:
        for t in transports:
            s = r[t]
            print(
                f"| {work.name} | {work.batch} | {t} | {r['local']:.1f} | {s['rate']:.1f} | "
                f"{s['overhead']:+.1%} | {s['per_batch_ms']:+.2f} ms | "
                f"{r['local_all_ms']:.2f} / {s['all_ms']:.2f} ms | {s['cpu_overhead']:+.1%} | "
                f"{r['local_cpu_ms']:.2f} / {s['cpu_ms']:.2f} ms | "
                f"{r['local_first_ms']:.0f} / {s['first_ms']:.0f} ms |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
