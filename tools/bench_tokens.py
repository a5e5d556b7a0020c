"""Token blocks for LM training: shardloader against LitData's TokensLoader, on the same corpus.

One command (in the peers' venv; shardloader from this checkout):

    . /work/main/.venv-bench/bin/activate
    PYTHONPATH=. python tools/bench_tokens.py [--docs 200000] [--repeat 3] [--markdown]

Corpus: ``--docs`` JSONL documents of lognormal length (mean ``--mean-tokens`` words; 200,000 x
272.5 = 54.5 M tokens), words ``w0 .. w31999`` drawn Zipf-like, and a word-level tokenizer
(``tokenizers``) that maps word ``wN`` to id N, so both systems get the same token ids.

* shardloader: ``shardloader pack --format tokens --tokenizer`` (zstd shards, staged once into
  the node cache, then memory-mapped), read with ``TokenBlocks(2048, 8, pad_id=vocab)``
  through ``make_loader``: dicts of int64 ``input_ids``, ``labels``, ``position_ids``,
  ``attention_mask`` [8, 2048] plus ``cu_seqlens``/``max_seqlen``.
* LitData: ``optimize(..., item_loader=TokensLoader())`` with uint16 items (chunks of 64 MB),
  read with ``StreamingDataset(item_loader=TokensLoader(block_size=2048))`` through
  ``StreamingDataLoader(batch_size=8)``: one uint16 tensor [8, 2048] per batch (nothing else).
* ``packed`` (``--systems``): the README's LM path before token shards, ``PackedBatches`` +
  ``PackCollate`` over tar shards of the same corpus (slow: off by default).
* ``lean`` (``--systems``): ``TokenBlocks(..., lean=True)``: uint16 ``input_ids`` with
  ``row_tokens``, ``cu_seqlens`` and ``__pad__``; the int64 fields are made on the GPU
  (``expand_on_device``, not run here: this row is the loader's side of it).
* ``base`` (``--systems``, with ``--base-root DIR``): the ``shardloader`` row read with the
  package of another checkout (e.g. ``git worktree add /tmp/base main``): before and after,
  interleaved in one run; ``base-lean`` the ``lean`` row read so.

Every measurement runs in a fresh process, systems and worker counts interleaved, ``--repeat``
times; medians are printed.  Tokens/s count ``input_ids`` slots of the epoch's batches after the
first one, timed from the first batch to the last (start-up is the time to first batch,
measured from constructing the dataset, imports done).  Memory, the process and its workers
together: peak ``RssAnon`` and ``RssShmem`` sampled from outside every 5 ms (``/proc/PID/status``;
a page a forked worker shares with its parent counts in both), and ``Pss_Anon`` (shared pages
split between their users) read once mid-epoch (after 1,000 batches; not timed).  Both
shuffle.  ``--profile`` prints a cProfile of shardloader's one-process epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchjson import write_figures  # noqa: E402
from cputree import TreeCPU  # noqa: E402

SEQ, ROWS = 2048, 8
VOCAB = 32000

# ------------------------------------------------------------------------------------ corpus


def make_corpus(work: str, docs: int, mean: float, seed: int) -> tuple[str, str]:
    """JSONL parts and a tokenizer under ``work``; reused when the parameters match."""
    folder, tok = os.path.join(work, "corpus"), os.path.join(work, "tokenizer.json")
    params = {"docs": docs, "mean": mean, "seed": seed, "vocab": VOCAB, "version": 1}
    stamp = os.path.join(work, "corpus.json")
    if os.path.exists(stamp) and json.load(open(stamp)) == params:
        return folder, tok
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    rng = np.random.default_rng(seed)
    sigma = 1.0
    lengths = np.maximum(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, docs), 1).astype(int)
    p = 1.0 / np.arange(1, VOCAB + 1) ** 1.1
    ids = rng.choice(VOCAB, size=int(lengths.sum()), p=p / p.sum())
    words = np.array([f"w{i}" for i in range(VOCAB)], dtype=object)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    parts = 8
    for part in range(parts):
        lo, hi = part * docs // parts, (part + 1) * docs // parts
        with open(os.path.join(folder, f"part-{part:05d}.jsonl"), "w") as f:
            for d in range(lo, hi):
                text = " ".join(words[ids[bounds[d] : bounds[d + 1]]])
                f.write(json.dumps({"id": d, "text": text}) + "\n")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab["[UNK]"] = VOCAB
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.save(tok)
    json.dump(params, open(stamp, "w"))
    return folder, tok


def _litdata_docs(path: str):  # one optimize input: a JSONL part
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.environ["BENCH_TOKENIZER"])
    with open(path) as f:
        for line in f:
            yield np.asarray(tok.encode(json.loads(line)["text"]).ids, np.uint16)


def pack_all(work: str, corpus: str, tok: str, systems: list[str]) -> dict[str, float]:
    """Pack what ``systems`` read (once; reused); return the seconds each pack took."""
    took: dict[str, float] = {}
    jobs = {"shardloader": ("sl-tokens", "tokens"), "packed": ("sl-tar", "tar")}
    for system, (name, fmt) in jobs.items():
        out = os.path.join(work, name)
        reads = {system, "lean", "base", "base-lean"} if system == "shardloader" else {system}
        if reads & set(systems) and not os.path.exists(os.path.join(out, "index.json")):
            from shardloader.pack import PackOptions, pack

            t0 = time.perf_counter()
            pack(corpus, out, PackOptions(format=fmt, tokenizer=tok, workers=2, overwrite=True))
            took[system] = time.perf_counter() - t0
    out = os.path.join(work, "litdata")
    if "litdata" in systems and not os.path.exists(os.path.join(out, "index.json")):
        from litdata import optimize
        from litdata.streaming.item_loader import TokensLoader

        os.environ["BENCH_TOKENIZER"] = tok
        files = sorted(os.path.join(corpus, f) for f in os.listdir(corpus))
        t0 = time.perf_counter()
        optimize(
            fn=_litdata_docs,
            inputs=files,
            output_dir=out,
            chunk_bytes="64MB",
            item_loader=TokensLoader(),
            num_workers=2,
            mode="overwrite",
        )
        took["litdata"] = time.perf_counter() - t0
    return took


# ------------------------------------------------------------------------------- one run


def _loader(system: str, work: str, workers: int):
    kw: dict = {"num_workers": workers}
    if workers:
        kw["multiprocessing_context"] = "fork"
    if system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        ds = StreamingDataset(
            os.path.join(work, "litdata"), item_loader=TokensLoader(block_size=SEQ), shuffle=True
        )
        return StreamingDataLoader(ds, batch_size=ROWS, **kw)
    import shardloader as sl

    vocab = VOCAB + 1
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=os.path.join(work, "cache")))
    if system in ("shardloader", "lean", "base", "base-lean"):
        from shardloader.batching.blocks import TokenBlocks

        lean = {"lean": True} if system in ("lean", "base-lean") else {}
        planner = TokenBlocks(SEQ, ROWS, pad_id=vocab, **lean)
        url = os.path.join(work, "sl-tokens")
    else:
        from shardloader.batching import PackedBatches

        planner = PackedBatches(SEQ, ROWS, pad_id=vocab)
        url = os.path.join(work, "sl-tar")
    ds = sl.ShardedDataset(url, planner=planner, shuffle=True, seed=0, read=read)
    return sl.make_loader(ds, **kw)


def child(system: str, work: str, workers: int, profile: bool) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    import torch  # noqa: F401 - imports are not start-up

    if system == "litdata":
        import litdata  # noqa: F401
    else:
        import shardloader.batching.blocks  # noqa: F401
        import shardloader.dataset  # noqa: F401
        import shardloader.deliver.loader  # noqa: F401
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    it = iter(_loader(system, work, workers))
    first = next(it)
    t1 = time.perf_counter()
    ids = first["input_ids"] if isinstance(first, dict) else first
    first_tokens = ids.numel()
    del first, ids  # a loop keeps no old batch
    c1 = time.process_time()
    tree = TreeCPU().start()  # this process and its workers (cputree.py)
    tokens = paused = paused_cpu = 0
    pss = 0.0
    for j, batch in enumerate(it):
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        tokens += ids.numel()
        if j == 1000:  # mid-epoch, every worker running: not timed
            t, c = time.perf_counter(), time.process_time()
            pss = pss_anon_mb(_tree(os.getpid()))
            paused, paused_cpu = time.perf_counter() - t, time.process_time() - c
    t2 = time.perf_counter() - paused
    cpu = time.process_time() - c1 - paused_cpu
    tree_cpu = tree.stop() - paused_cpu
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    out = {"ttfb": t1 - t0, "tokens": tokens + first_tokens, "seconds": t2 - t1, "rest": tokens}
    out["pss_anon_mb"] = pss
    out["cpu"] = cpu  # of this process (all its threads), the workers not counted
    out["tree_cpu"] = tree_cpu  # of this process and its workers
    print(json.dumps(out), flush=True)


# ------------------------------------------------------------------------------- parent


def _status_kb(pid: int) -> tuple[int, int]:
    """(``RssAnon``, ``RssShmem``) of a process in KiB: counters the kernel keeps, cheap to read
    (reading smaps walks the page tables, ~30 ms a read here, and slowed the run it measured)."""
    anon = shmem = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
                elif line.startswith("RssShmem:"):
                    shmem = int(line.split()[1])
    except OSError:
        pass
    return anon, shmem


def pss_anon_mb(pids: list[int]) -> float:
    """Proportional anonymous memory of ``pids`` together (``Pss_Anon``: a page a forked worker
    still shares with its parent counts half in each), from smaps_rollup."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss_Anon:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _tree(pid: int) -> list[int]:
    import psutil

    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return [pid]


BASE_ROOT = ROOT  # the checkout the "base" system imports shardloader from (--base-root)


def run_child(system: str, work: str, workers: int, profile: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", system, "--work", work]
    cmd += ["--workers", str(workers)] + (["--profile"] if profile else [])
    root = BASE_ROOT if system.startswith("base") else ROOT
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, env=env, text=True)
    peak = peak_shm = 0
    while proc.poll() is None:
        sizes = [_status_kb(p) for p in _tree(proc.pid)]
        peak = max(peak, sum(a for a, _ in sizes))
        peak_shm = max(peak_shm, sum(s for _, s in sizes))
        time.sleep(0.005)
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{system} workers={workers} failed ({proc.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    result["anon_mb"] = peak / 1024
    result["shmem_mb"] = peak_shm / 1024
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--mean-tokens", type=float, default=272.5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--systems", default="shardloader,litdata")
    ap.add_argument("--work", default=os.path.join(ROOT, "bench-out", "tokens"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-system", default="shardloader", help="what --profile runs")
    ap.add_argument("--base-root", default=ROOT, help="the checkout the 'base' system reads")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", default=None, help="also write the table's rows and every run here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.work, int(args.workers), args.profile)
        return
    global BASE_ROOT
    BASE_ROOT = os.path.abspath(args.base_root)
    systems = args.systems.split(",")
    workers = [int(w) for w in args.workers.split(",")]
    os.makedirs(args.work, exist_ok=True)
    t0 = time.perf_counter()
    corpus, tok = make_corpus(args.work, args.docs, args.mean_tokens, args.seed)
    print(f"corpus ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    took = pack_all(args.work, corpus, tok, systems)
    for system, seconds in took.items():
        print(f"packed for {system} in {seconds:.1f} s", file=sys.stderr)
    if args.profile:
        for w in workers:
            run_child(args.profile_system, args.work, w)  # staged, then profiled warm
            run_child(args.profile_system, args.work, w, profile=True)
        return
    cold = {}  # each system's first batch from an empty node cache (it stages the shards)
    for system in systems:
        shutil.rmtree(os.path.join(args.work, "cache"), ignore_errors=True)
        cold[system] = run_child(system, args.work, 0)["ttfb"]
    results: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.repeat):
        for w in workers:
            for system in systems:
                r = run_child(system, args.work, w)
                results.setdefault((system, w), []).append(r)
                print(f"{system} workers={w}: {r}", file=sys.stderr)
    report(results, cold, systems, workers, args)
    if args.json:
        write_json(args.json, results, cold)


def write_json(path: str, results: dict[tuple[str, int], list[dict]], cold: dict) -> None:
    """The table as rows (medians; what tools/plot_benchmarks.py draws), and every run."""
    rows = []
    for (system, w), runs in results.items():
        rows.append(
            {
                "system": system,
                "workers": w,
                "mtok_s": statistics.median(r["rest"] / r["seconds"] / 1e6 for r in runs),
                "main_cpu_us_per_batch": statistics.median(
                    r["cpu"] / (r["rest"] / (ROWS * SEQ)) * 1e6 for r in runs
                ),
                "tree_cpu_us_per_batch": statistics.median(
                    r.get("tree_cpu", r["cpu"]) / (r["rest"] / (ROWS * SEQ)) * 1e6 for r in runs
                ),
                "first_batch_s": statistics.median(r["ttfb"] for r in runs),
                "peak_anon_mb": statistics.median(r["anon_mb"] for r in runs),
                "pss_anon_mb": statistics.median(r["pss_anon_mb"] for r in runs),
            }
        )
    every = [{"system": s, "workers": w, **r} for (s, w), rs in results.items() for r in rs]
    write_figures(
        path,
        __file__,
        {"rows": rows, "cold_first_batch_s": cold, "runs": every, "load": os.getloadavg()},
    )


def report(results, cold, systems, workers, args) -> None:
    def med(system: str, w: int, key: str) -> float:
        def one(r: dict) -> float:
            if key == "mtok":
                return r["rest"] / r["seconds"] / 1e6
            if key == "cpu_us":  # main-process CPU per batch of ROWS x SEQ tokens
                return r["cpu"] / (r["rest"] / (ROWS * SEQ)) * 1e6
            if key == "tree_us":  # the same, this process and its workers
                return r["tree_cpu"] / (r["rest"] / (ROWS * SEQ)) * 1e6
            return float(r[key])

        values = [one(r) for r in results[(system, w)]]
        return statistics.median(values)

    print(f"\nload average {os.getloadavg()}; {args.docs:,} documents, medians of {args.repeat}")
    print(
        "| system | workers | M tokens/s | CPU µs/batch: main / all processes | time to first "
        "batch (s) | peak RssAnon MB | Pss_Anon MB mid-epoch | peak RssShmem MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    summary = []
    for system in systems:
        for w in workers:
            row = {
                k: med(system, w, k)
                for k in ("mtok", "cpu_us", "tree_us", "ttfb", "anon_mb", "pss_anon_mb", "shmem_mb")
            }
            summary.append({"system": system, "workers": w, **row})
            print(
                f"| {system} | {w} | {row['mtok']:.1f} | {row['cpu_us']:.0f} / "
                f"{row['tree_us']:.0f} | {row['ttfb']:.3f} | {row['anon_mb']:.0f} "
                f"| {row['pss_anon_mb']:.0f} | {row['shmem_mb']:.0f} |"
            )
    print("\ntime to first batch with an empty node cache (stages shards):", cold)
    if "shardloader" in systems and "litdata" in systems and 0 in workers:
        one = med("shardloader", 0, "mtok")
        print("\n| goal | measured |\n|---|---|")
        print(
            f"| one process >= 3x LitData | {one / med('litdata', 0, 'mtok'):.2f}x (CPU per batch "
            f"{med('litdata', 0, 'tree_us') / med('shardloader', 0, 'tree_us'):.2f}x less) |"
        )
        for w in workers:
            if w:
                mine = med("shardloader", w, "mtok") / one
                theirs = med("litdata", w, "mtok") / med("litdata", 0, "mtok")
                cpu = med("shardloader", w, "tree_us") / med("shardloader", 0, "tree_us")
                print(
                    f"| {w} workers >= 90 % of one process | {mine:.0%} (LitData {theirs:.0%}); "
                    f"all processes spend {cpu:.2f}x the one-process CPU per batch |"
                )
                for key, what in (("anon_mb", "peak RssAnon"), ("pss_anon_mb", "Pss_Anon")):
                    ratio = med("shardloader", w, key) / med("litdata", w, key)
                    print(f"| {what}, {w} workers <= LitData | {ratio:.2f}x |")
        print(f"| time to first batch < 0.1 s | {med('shardloader', 0, 'ttfb'):.3f} s |")


if __name__ == "__main__":
    main()
