"""The whole job in one command: raw images → shards → checked → streamed → a model trains.

    python tools/demo.py [--workdir DIR] [--keep]

1. generates a small class-folder corpus mixed as real folders are: .jpg/.jpeg/.png in RGB,
   grey, CMYK, RGBA, palette and 16-bit (``tools/make_corpus.py`` when present, else JPEG
   pictures of circles, squares and stripes made here);
2. ``shardloader pack`` → ``inspect`` → ``verify``;
3. streams one epoch through ``make_loader`` with worker processes;
4. trains ``tools/train_image.py`` for a few steps and prints the data-bound share.

Each command is printed as you would type it, then run here (the same code the ``shardloader``
entry point runs, without starting Python again).  Exits non-zero if any step fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import shutil
import sys
import tempfile
import time
import traceback
from types import ModuleType

import numpy as np

TOOLS = os.path.dirname(os.path.abspath(__file__))
CLASSES = ("circle", "square", "stripes")


class StepFailed(Exception):
    pass


def _load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    if spec is None or spec.loader is None:
        raise StepFailed(f"cannot load tools/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so its functions pickle into worker processes
    spec.loader.exec_module(module)
    return module


def _image(kind: str, rng: np.random.Generator) -> bytes:
    """A noisy picture of a circle, a square or stripes, of varying size."""
    from PIL import Image

    h, w = int(rng.integers(28, 48)), int(rng.integers(28, 48))
    yy, xx = np.mgrid[0:h, 0:w]
    cy, cx, r = h / 2, w / 2, min(h, w) / 3
    if kind == "circle":
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
    elif kind == "square":
        mask = (abs(yy - cy) < r) & (abs(xx - cx) < r)
    else:
        mask = (xx // 4) % 2 == 0
    pixels = rng.integers(0, 90, (h, w, 3))
    pixels[mask] += np.array([150, 120, 60])[rng.permutation(3)]
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def make_corpus(corpus: str, per_class: int) -> str:
    """Write a class-folder corpus under ``corpus``; return the folder to pack."""
    if os.path.exists(os.path.join(TOOLS, "make_corpus.py")):
        n = per_class * len(CLASSES)
        print(
            f"$ python tools/make_corpus.py {corpus} --images {n} --classes {len(CLASSES)} "
            "--docs 0",
            flush=True,
        )
        _load_tool("make_corpus").make_corpus(
            corpus, images=n, classes=len(CLASSES), docs=0, jobs=2
        )
        return os.path.join(corpus, "images")
    root = os.path.join(corpus, "images")
    rng = np.random.default_rng(0)
    for kind in CLASSES:
        os.makedirs(os.path.join(root, kind))
        for i in range(per_class):
            with open(os.path.join(root, kind, f"{i:04d}.jpg"), "wb") as f:
                f.write(_image(kind, rng))
    print(f"generated {len(CLASSES)} classes x {per_class} JPEGs in {root}", flush=True)
    return root


def shardloader(*args: str) -> None:
    """Run a ``shardloader`` command in this process, as the entry point would."""
    from shardloader.cli import main

    print("$ shardloader " + " ".join(args), flush=True)
    try:
        main.main(args=list(args), prog_name="shardloader", standalone_mode=False)
    except SystemExit as done:
        if done.code not in (0, None):
            raise StepFailed(f"shardloader {args[0]} exited {done.code}") from None
    except Exception as err:  # click's own errors, anything unexpected
        raise StepFailed(f"shardloader {args[0]} failed: {err}") from err


def stream(packed: str, cache: str) -> None:
    import shardloader as sl
    from shardloader.vision import train_transform

    print(
        ">>> loader = make_loader(ShardedDataset(packed, batch_size=16, shuffle=True, "
        "decoder=Decoder(image='raw'), transform=train_transform(32)), num_workers=2)",
        flush=True,
    )
    ds = sl.ShardedDataset(
        packed,
        batch_size=16,
        shuffle=True,
        seed=0,
        decoder=sl.Decoder(image="raw"),
        transform=train_transform(32),  # the field "image": every format
        read=sl.ReadOptions(cache=sl.CacheOptions(dir=cache)),
    )
    started = time.perf_counter()
    batches = list(sl.make_loader(ds, num_workers=2))
    seconds = time.perf_counter() - started
    first = batches[0]
    real = sum(int((~b["__pad__"]).sum()) for b in batches)
    print(
        f"  {len(batches)} batches, {real} real samples + {ds.report().padded_samples} "
        f"padding in {seconds:.2f}s; batch: image {tuple(first['image'].shape)} "
        f"{first['image'].dtype}, cls {first['cls'].tolist()[:8]}...",
        flush=True,
    )
    if real != ds.manifest.num_samples:
        raise StepFailed(f"streamed {real} samples, the manifest holds {ds.manifest.num_samples}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=None, help="default: a temporary folder")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--per-class", type=int, default=40)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="shardloader-demo-")
    os.makedirs(work, exist_ok=True)
    raw, packed, cache = (os.path.join(work, d) for d in ("raw", "packed", "cache"))
    started = time.perf_counter()
    try:
        for d in (raw, packed, cache):
            shutil.rmtree(d, ignore_errors=True)
        print("== 1. a raw corpus", flush=True)
        images = make_corpus(raw, args.per_class)
        print("== 2. pack, inspect, verify", flush=True)
        shardloader("pack", images, packed, "--shard-size", "1MB")
        shardloader("inspect", packed)
        shardloader("verify", packed)
        print("== 3. stream", flush=True)
        stream(packed, cache)
        print("== 4. train (tools/train_image.py)", flush=True)
        train = _load_tool("train_image")
        cmd = [
            packed,
            "--steps",
            str(args.steps),
            "--batch-size",
            "16",
            "--workers",
            "2",
            "--log-every",
            str(max(1, args.steps // 3)),
            "--cache-dir",
            cache,
        ]
        print("$ python tools/train_image.py " + " ".join(cmd), flush=True)
        if train.train(train.parse(cmd)) != 0:
            raise StepFailed("train_image.py failed")
    except StepFailed as err:
        print(f"demo FAILED: {err}", file=sys.stderr, flush=True)
        return 1
    except Exception:  # a bug anywhere: the traceback, then a failing exit status
        traceback.print_exc()
        print("demo FAILED (see the traceback above)", file=sys.stderr, flush=True)
        return 1
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"== done in {time.perf_counter() - started:.1f}s. Next: shardloader bench "
        f"{packed if args.keep or args.workdir else 'DATASET'} finds the best num_workers.",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
