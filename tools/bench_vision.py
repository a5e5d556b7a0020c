"""Images/s of the decode + augment pipeline against a bare PIL decode loop on the same cores.

N JPEGs (about ``--size`` pixels, varied a little) are generated in memory.  The *limit* is a
bare ``Image.open(...).load()`` loop over them in ``--workers`` processes; the *pipeline* is a
torch DataLoader (``num_workers=--workers``, batch ``--batch-size``) over a map-style dataset of
the JPEG bytes with ``shardloader.vision.train_transform(224, field="jpg")`` and PadCollate,
delivering uint8 batches to the main process.  Both are timed after a warm-up pass (workers
started), taking turns, best of ``--reps``.  Also reported: CPU time per image (all
processes), which other load on a shared machine disturbs far less than wall time.  A
single-process per-stage breakdown explains the gap.

    python tools/bench_vision.py [--images 2000] [--sizes 400x350,800x700] [--markdown]
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import time
from typing import Any

import numpy as np
import psutil
import torch
from PIL import Image, ImageFilter

from shardloader.collate import PadCollate
from shardloader.vision import RandomHorizontalFlip, RandomResizedCrop, train_transform

_IMAGES: list[bytes] = []  # inherited by forked processes, never pickled


def make_jpegs(n: int, width: int, height: int, seed: int) -> list[bytes]:
    """Photo-like JPEGs (gradients, blurred texture, noise; quality 90), sizes within ±10 %."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w = int(width * rng.uniform(0.9, 1.1))
        h = int(height * rng.uniform(0.9, 1.1))
        texture = rng.normal(0, 1, (h // 4 + 1, w // 4 + 1, 3))
        texture = np.kron(texture, np.ones((4, 4, 1)))[:h, :w]
        x, y = np.linspace(0, 6, w), np.linspace(0, 5, h)
        phase = rng.uniform(0.5, 2.0, 3)
        grad = np.sin(x[None, :, None] * phase + y[:, None, None] * phase[::-1])
        pixels = grad * 60 + texture * 30 + rng.normal(0, 10, (h, w, 3)) + 128
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        buf = io.BytesIO()
        image.filter(ImageFilter.GaussianBlur(0.7)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _decode_part(part: tuple[int, int]) -> int:
    for data in _IMAGES[part[0] : part[1]]:
        Image.open(io.BytesIO(data)).load()
    return part[1] - part[0]


class BareDecode:
    """The limit: ``Image.open(...).load()`` over the images, split over ``workers`` processes."""

    def __init__(self, workers: int) -> None:
        n = len(_IMAGES)
        self.parts = [(k * n // workers, (k + 1) * n // workers) for k in range(workers)]
        self.pool = multiprocessing.get_context("fork").Pool(workers)
        self.pool.map(_decode_part, self.parts, chunksize=1)  # warm-up

    def epoch(self) -> int:
        return sum(self.pool.map(_decode_part, self.parts, chunksize=1))

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


class JpegDataset(torch.utils.data.Dataset):
    """Map-style dataset of JPEG bytes (ShardedDataset will stand here)."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def __len__(self) -> int:
        return len(_IMAGES)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.transform({"jpg": _IMAGES[i], "cls": i})


class Pipeline:
    """DataLoader over JpegDataset with the train transform; persistent workers."""

    def __init__(self, workers: int, batch_size: int, channels_last: bool) -> None:
        self.loader = torch.utils.data.DataLoader(
            JpegDataset(train_transform(224, field="jpg", channels_last=channels_last)),
            batch_size=batch_size,
            shuffle=True,
            num_workers=workers,
            collate_fn=PadCollate(),
            persistent_workers=True,
            prefetch_factor=4,
            multiprocessing_context=multiprocessing.get_context("fork"),
        )
        assert self.epoch() == len(_IMAGES)  # warm-up: starts the workers

    def epoch(self) -> int:
        seen = 0
        for batch in self.loader:
            assert batch["jpg"].dtype == torch.uint8
            seen += len(batch["cls"])
        return seen

    def close(self) -> None:
        del self.loader


def _cpu_seconds() -> float:
    """CPU time of this process and its live children (pool / DataLoader workers)."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def interleaved(runners: dict[str, Any], reps: int) -> dict[str, tuple[float, float]]:
    """Per runner: best wall images/s and least CPU ms per image, taking turns so load from
    elsewhere on the machine hits all alike."""
    best = {name: (0.0, float("inf")) for name in runners}
    for _ in range(reps):
        for name, runner in runners.items():
            t0, c0 = time.perf_counter(), _cpu_seconds()
            n = runner.epoch()
            wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
            best[name] = (max(best[name][0], n / wall), min(best[name][1], 1e3 * cpu / n))
    for runner in runners.values():
        runner.close()
    return best


def stages(sample: int = 300) -> dict[str, float]:
    """Single-process CPU ms/image, cumulative stages (torch on one thread, as in a worker)."""
    images = _IMAGES[:sample]
    crop, flip = RandomResizedCrop(224), RandomHorizontalFlip()
    collate = PadCollate()
    chw, hwc = (
        train_transform(224, field="jpg"),
        train_transform(224, field="jpg", channels_last=True),
    )
    out = {}

    def timed(name: str, fn: Any) -> None:
        best = float("inf")
        for _ in range(3):
            torch.manual_seed(0)
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        out[name] = 1e3 * best / len(images)

    def batched(transform: Any) -> Any:
        def run() -> None:
            for start in range(0, len(images), 64):
                part = images[start : start + 64]
                collate([transform({"jpg": d, "cls": 0}) for d in part])

        return run

    timed("bare decode", lambda: [Image.open(io.BytesIO(d)).load() for d in images])
    timed("decode (drafted) + crop + resize", lambda: [crop(d) for d in images])
    timed("+ flip", lambda: [flip(crop(d)) for d in images])
    timed("+ contiguous CHW + collate", batched(chw))
    timed("HWC + collate", batched(hwc))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--sizes", default="400x350", help="comma-separated WxH, e.g. 400x350,800x700")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    rows = []
    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.lower().split("x"))
        _IMAGES[:] = make_jpegs(args.images, width, height, seed=0)
        kb = sum(map(len, _IMAGES)) / len(_IMAGES) / 1024
        runners = {
            "limit": BareDecode(args.workers),
            "chw": Pipeline(args.workers, args.batch_size, channels_last=False),
            "hwc": Pipeline(args.workers, args.batch_size, channels_last=True),
        }
        best = interleaved(runners, args.reps)
        rows.append((f"{width}x{height} ({kb:.0f} KB)", *best.values(), stages()))

    header = (
        "JPEGs",
        "bare decode img/s",
        "pipeline CHW img/s",
        "pipeline HWC img/s",
        "CPU ms/img bare / CHW / HWC",
        "CHW / limit (wall, CPU)",
        "HWC / limit (wall, CPU)",
    )
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
    for name, (lw, lc), (cw, cc), (hw, hc), _ in rows:
        cells = (
            name,
            f"{lw:.0f}",
            f"{cw:.0f}",
            f"{hw:.0f}",
            f"{lc:.2f} / {cc:.2f} / {hc:.2f}",
            f"{cw / lw:.0%}, {lc / cc:.0%}",
            f"{hw / lw:.0%}, {lc / hc:.0%}",
        )
        print(("| " + " | ".join(cells) + " |") if args.markdown else "  ".join(cells))
    print()
    for name, *_, st in rows:
        print(
            f"per-stage ms/image, one process, {name}: "
            + ", ".join(f"{k.strip()} {v:.2f}" for k, v in st.items())
        )


if __name__ == "__main__":
    main()
