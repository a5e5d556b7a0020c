"""Parquet read in place: ``shardloader index`` + ``ShardedDataset`` against Hugging Face
``datasets`` streaming of the same files.

One command (shardloader from this checkout):

    PYTHONPATH=. python tools/bench_parquet.py [--rows 20000] [--files 4] [--repeat 3] [--json F]

Corpus: a Hub-style dump written by ``datasets.Dataset.to_parquet`` (``data/train-0000k-of-
0000n.parquet``, its default row groups), each row an ``Image`` (a 32x32 PNG of noise, 3.2 KB), a
``ClassLabel`` and a short string; reused when the parameters match.

* shardloader: ``index`` once (timed apart), then an epoch of ``ShardedDataset(index.json,
  batch_size=64)`` through ``make_loader``, images as bytes (``Decoder(image="raw")``) so
  neither system decodes pixels; shuffled (``shardloader``) and in file order
  (``shardloader-ordered``, as datasets reads); and shuffled with ``ReadOptions(fields=("label",
  "text"))`` (``shardloader-projected``): only those columns are read and checked.
* datasets: ``load_dataset("parquet", data_files=..., streaming=True)`` with the image column
  cast to ``Image(decode=False)`` (bytes), through a torch ``DataLoader(batch_size=64)``
  (``num_workers`` > 0 splits the files among workers, as datasets documents); unshuffled,
  since its streaming shuffle is a buffer, not an order over the rows.

Every measurement runs in a fresh process, systems and worker counts interleaved, ``--repeat``
times; medians are printed with the machine's load.  Rows/s count every row of the epoch, timed
from constructing the dataset (imports done) to the last batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchjson import machine, write_figures  # noqa: E402

BATCH = 64
# shardloader shuffled; in file order, as datasets' streaming reads; shuffled, two columns
SYSTEMS = ("shardloader", "shardloader-ordered", "shardloader-projected", "datasets")


def make_corpus(work: str, rows: int, files: int) -> str:
    """The dump's folder under ``work``; reused when the parameters match."""
    folder = os.path.join(work, "hub")
    stamp = os.path.join(work, "corpus.json")
    params = {"rows": rows, "files": files, "version": 2}
    if os.path.exists(stamp):
        with open(stamp, encoding="utf-8") as f:
            if json.load(f) == params:
                return folder
    import io

    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=[f"c{i}" for i in range(10)]),
            "text": datasets.Value("string"),
        }
    )
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    per = -(-rows // files)
    for k in range(files):
        n = min(per, rows - k * per)
        images = []
        for _ in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), np.uint8)).save(buf, "PNG")
            images.append({"bytes": buf.getvalue(), "path": None})
        ds = datasets.Dataset.from_dict(
            {
                "image": images,
                "label": rng.integers(0, 10, n).tolist(),
                "text": [f"row {k * per + i} of the benchmark" for i in range(n)],
            },
            features=features,
        )
        ds.to_parquet(os.path.join(folder, "data", f"train-{k:05d}-of-{files:05d}.parquet"))
    for name in os.listdir(folder):
        if name.endswith(".json"):
            os.remove(os.path.join(folder, name))
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump(params, f)
    return folder


def run_index(folder: str) -> float:
    from shardloader.pack.index_existing import index_shards

    start = time.perf_counter()
    index_shards([os.path.join(folder, "data")], folder, overwrite=True)
    return time.perf_counter() - start


def collate_rows(rows: list[dict]) -> dict:
    """A batch as shardloader's default collate gives it: image bytes and texts as lists,
    labels as a tensor (torch's default collate refuses the image cell's ``path: None``)."""
    import torch

    return {
        "image": [r["image"]["bytes"] for r in rows],
        "label": torch.tensor([r["label"] for r in rows]),
        "text": [r["text"] for r in rows],
    }


def child(system: str, folder: str, workers: int, cache: str) -> dict[str, float]:
    """One epoch of ``system`` with ``workers`` workers: rows and seconds (imports done
    before the clock starts: torch's alone takes seconds on a loaded machine)."""
    import datasets
    import torch

    import shardloader as sl
    from shardloader.dataset import ShardedDataset  # noqa: F401  (the lazy names, now)

    start = time.perf_counter()
    rows = 0
    if system.startswith("shardloader"):
        fields = ("label", "text") if system == "shardloader-projected" else None
        ds = sl.ShardedDataset(
            folder,
            batch_size=BATCH,
            shuffle=system != "shardloader-ordered",
            seed=0,
            decoder=sl.Decoder(image="raw"),
            read=sl.ReadOptions(cache=sl.CacheOptions(dir=cache), fields=fields),
        )
        for batch in sl.make_loader(ds, num_workers=workers):
            rows += int((~batch["__pad__"].bool()).sum())
    else:
        files = sorted(
            os.path.join(folder, "data", n)
            for n in os.listdir(os.path.join(folder, "data"))
            if n.endswith(".parquet")
        )
        ds = datasets.load_dataset("parquet", data_files={"train": files}, streaming=True)
        ds = ds["train"].cast_column("image", datasets.Image(decode=False))
        loader = torch.utils.data.DataLoader(
            ds, batch_size=BATCH, num_workers=workers, collate_fn=collate_rows
        )
        for batch in loader:
            rows += len(batch["label"])
    return {"rows": rows, "seconds": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--workers", default="0,2", help="worker counts, comma-separated")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--work", default="/tmp/shardloader-bench-parquet")
    p.add_argument("--json", help="write the figures here (tools/benchjson.py)")
    p.add_argument(
        "--child", nargs=3, metavar=("SYSTEM", "WORKERS", "CACHE"), help=argparse.SUPPRESS
    )
    a = p.parse_args()
    folder = os.path.join(a.work, "hub")
    if a.child:
        system, workers, cache = a.child
        print(
            json.dumps(
                child(system, os.path.join(folder, "index.json"), int(workers), cache)
                if system.startswith("shardloader")
                else child(system, folder, int(workers), cache)
            )
        )
        return
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    make_corpus(a.work, a.rows, a.files)
    index_s = run_index(folder)
    size = sum(
        os.path.getsize(os.path.join(folder, "data", n))
        for n in os.listdir(os.path.join(folder, "data"))
        if n.endswith(".parquet")
    )
    print(f"{a.rows:,} rows in {a.files} files, {size / 1e6:.1f} MB; index took {index_s:.2f} s")
    print(machine())
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    runs: dict[str, list[dict[str, float]]] = {}
    workers = [int(w) for w in a.workers.split(",")]
    for rep in range(a.repeat):
        for w in workers:
            for system in SYSTEMS:  # interleaved
                cache = os.path.join(a.work, f"cache-{rep}-{w}")  # local files: read in place
                out = subprocess.run(
                    [sys.executable, __file__, "--work", a.work, "--child", system, str(w), cache],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                got = json.loads(out.stdout.strip().splitlines()[-1])
                if got["rows"] != a.rows:
                    raise SystemExit(f"{system} delivered {got['rows']} rows of {a.rows}")
                runs.setdefault(f"{system} x{w}", []).append(got)
    rows = []
    print(f"{'system':<24} {'rows/s (median)':>16} {'seconds':>8}   runs")
    for name, got in runs.items():
        secs = statistics.median(g["seconds"] for g in got)
        rate = a.rows / secs
        rows.append({"system": name, "rows_per_s": round(rate), "seconds": round(secs, 3)})
        each = ", ".join(f"{g['seconds']:.2f}" for g in got)
        print(f"{name:<24} {rate:>16,.0f} {secs:>8.2f}   {each}")
    print(machine())
    if a.json:
        write_figures(
            a.json,
            __file__,
            {
                "rows": rows,
                "corpus": {"rows": a.rows, "files": a.files, "bytes": size},
                "index_seconds": round(index_s, 3),
            },
        )


if __name__ == "__main__":
    main()
