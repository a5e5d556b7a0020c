"""Shuffle quality on class-sorted data: shardloader's block shuffle against webdataset's shard
shuffle + buffer holding as many samples (distinct classes per batch; a true global shuffle is
the ceiling).  One command, in a venv with webdataset (``/work/main/.venv-bench``)::

    python tools/bench_shuffle.py --samples 20000 --batch-size 32

(Split out of tools/bench_read.py, which measures throughput.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from synthetic import shard_name, write_manifest, write_shard  # noqa: E402

import shardloader as sl  # noqa: E402
from shardloader.manifest import FieldInfo, Manifest  # noqa: E402


def class_mix(labels_per_batch: list[list[int]]) -> float:
    """Mean number of distinct classes per batch."""
    return float(np.mean([len(set(b)) for b in labels_per_batch]))


def write_shardloader(samples: list[tuple[str, int]], out: str, per_shard: int) -> None:
    fields = {"bin": FieldInfo("bytes"), "cls": FieldInfo("int")}
    shards = []
    for n, lo in enumerate(range(0, len(samples), per_shard)):
        part = samples[lo : lo + per_shard]
        rows = ((key, {"bin": b"x", "cls": str(label).encode()}) for key, label in part)
        shards.append(write_shard(out, shard_name(n), "tar", "none", fields, rows))
    write_manifest(out, Manifest("tar", "none", fields, shards))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--work", default="bench-out/shuffle")
    args = ap.parse_args()
    import webdataset as wds

    n, batch = args.samples, args.batch_size
    samples = [(f"c{i * 10 // n}/{i:07d}", i * 10 // n) for i in range(n)]
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(os.path.join(args.work, "sl"))
    os.makedirs(os.path.join(args.work, "wds"))
    write_shardloader(samples, os.path.join(args.work, "sl"), max(1, n // 64))
    pattern = os.path.join(args.work, "wds", "wds-%05d.tar")
    with wds.ShardWriter(pattern, maxcount=max(1, n // 64), verbose=0) as sink:
        for key, label in samples:
            sink.write({"__key__": key.replace("/", "_"), "bin": b"x", "cls": label})
    urls = sorted(
        os.path.join(args.work, "wds", f) for f in os.listdir(os.path.join(args.work, "wds"))
    )
    perm = np.array([label for _, label in samples])[np.random.default_rng(0).permutation(n)]
    ideal = class_mix([perm[i : i + batch].tolist() for i in range(0, n - batch + 1, batch)])
    print(
        f"Shuffle quality on class-sorted data ({n} samples, 10 classes, batches of {batch}): "
        f"distinct classes per batch (global shuffle = {ideal:.2f})\n"
    )
    print("| samples held | shardloader block shuffle | webdataset shardshuffle + buffer |")
    print("|---:|---:|---:|")
    for held in (1000, 5000, n):
        ds = sl.ShardedDataset(
            os.path.join(args.work, "sl"),
            batch_size=batch,
            shuffle=sl.ShuffleOptions(True, block=held),
            uneven="drop",
        )
        ours = class_mix([b["cls"].tolist() for b in sl.make_loader(ds)])
        pipe = (
            wds.WebDataset(urls, shardshuffle=100, empty_check=False, seed=0)
            .shuffle(held, initial=held)
            .batched(batch, partial=False)
        )
        theirs = class_mix([[int(c) for c in b["cls"]] for b in pipe])
        print(f"| {held} | {ours:.2f} | {theirs:.2f} |")


if __name__ == "__main__":
    main()
