"""JPEG train/eval pipelines: shardloader against bare decodes and its peers, same bytes, one run.

N photo-like JPEGs per ``--sizes`` entry (generated in memory, sizes within ±10 %) are written
once as class folders (ImageFolder), packed by shardloader (tar.zst), webdataset (tar), LitData
and MosaicML (MDS); every loader then delivers uint8 224x224 batches of 64 from ``--workers``
DataLoader workers (fork), timed epoch by epoch, runners taking turns (``--reps`` rounds),
medians printed, with the CPU time per image of all processes and the machine's load:

* bare decodes in ``--workers`` processes (no loader): PIL ``Image.open().load()`` (the issue's
  limit) and libjpeg-turbo's full decode through shardloader's native decoder (stricter: PIL's
  own overhead removed);
* the train pipeline's physical limit, in this process: the native decode of each crop box plus
  the resize to 224 and nothing else (``bare ops``: the goal is train CPU <= 1.15x this);
* shardloader: ``Decoder(image="raw")`` + ``vision.train_transform(224)`` (the crop decoded
  alone, see shardloader/codecs/jpeg.py), the same with ``backend="pil"`` (the fallback), and
  ``vision.eval_transform(224)``;
* peers (where installed): torchvision-style ``RandomResizedCrop(224) + RandomHorizontalFlip``
  on uint8 tensors decoded by ``torchvision.io.decode_jpeg`` (their fastest CPU pipeline;
  measured faster than PIL decode + PIL resize), over webdataset, LitData, MosaicML and plain
  files (the row "plain files + torchvision decode_jpeg + v2 RandomResizedCrop", the goal's
  best peer: shardloader's train row should reach 2x its img/s and half its CPU); plus
  ImageFolder with torchvision's default PIL loader and transforms.

A single-process profile (CPU ms per image, per stage) comes after the table.

    . /work/main/.venv-bench/bin/activate   # torch + torchvision, webdataset, litdata, streaming
    PYTHONPATH=. python tools/bench_vision.py [--images 2000] [--sizes 500x375,1024x768] \\
        [--reps 5] [--workers 2] [--only "NAME;NAME"]
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageFilter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cputree import tree_cpu  # noqa: E402

import shardloader as sl  # noqa: E402
from shardloader import vision  # noqa: E402
from shardloader.pack import PackOptions, pack  # noqa: E402
from shardloader.vision import jpeg  # noqa: E402
from shardloader.vision.image import Encoded, crop, resize_chw  # noqa: E402

_IMAGES: list[bytes] = []  # inherited by forked processes, never pickled
BATCH = 64
SIZE = 224
PEER = "plain files + torchvision decode_jpeg + v2 RandomResizedCrop"  # the best peer
FLOOR = "bare ops: decode of the crop box + resize to 224, 1 process"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--sizes", default="500x375", help="comma-separated WxH, e.g. 500x375,1024x768")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--only", default="", help="runner names separated by ';' (default: all; names hold commas)"
    )
    ap.add_argument("--json", help="write the medians here")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------- corpus


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


def write_folders(root: str) -> list[tuple[str, int]]:
    """Class folders c0..c9 (ImageFolder's layout); (path, label) in order."""
    out = []
    for i, data in enumerate(_IMAGES):
        label = i % 10
        path = os.path.join(root, f"c{label}", f"{i:06d}.jpg")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        out.append((path, label))
    return out


# ----------------------------------------------------------------------------------- runners


def _decode_part(part: tuple[int, int, str]) -> int:
    lo, hi, how = part
    for data in _IMAGES[lo:hi]:
        if how == "pil":
            Image.open(io.BytesIO(data)).load()
        else:
            crop(Encoded(data))  # libjpeg-turbo, whole image, RGB
    return hi - lo


class BareDecode:
    """The limit: a decode loop over the images split over ``workers`` processes, no loader."""

    def __init__(self, workers: int, how: str) -> None:
        n = len(_IMAGES)
        self.parts = [(k * n // workers, (k + 1) * n // workers, how) for k in range(workers)]
        self.pool = multiprocessing.get_context("fork").Pool(workers)
        self.pool.map(_decode_part, self.parts, chunksize=1)  # warm-up

    def epoch(self) -> int:
        return sum(self.pool.map(_decode_part, self.parts, chunksize=1))

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


class BareOps:
    """The physical limit of the train pipeline, in this process: the native decode of each
    image's random-resized-crop box (flipped half the time, at the draft scale) and the resize
    of it to 224, nothing else (boxes drawn and sizes read beforehand, not timed)."""

    def __init__(self) -> None:
        rrc = vision.RandomResizedCrop(SIZE, flip=0.5)
        g = torch.Generator().manual_seed(0)
        self.work = []
        for data in _IMAGES:
            size = Encoded(data).size
            box, flip = rrc.draw(*size, generator=g)
            self.work.append((data, size, box, jpeg.request(size, box, (SIZE, SIZE)), flip))

    def epoch(self) -> int:
        hw = (SIZE, SIZE)
        for data, size, box, wanted, flip in self.work:
            x = jpeg.decode_box(data, size, box, wanted, flip=flip)
            assert x is not None
            resize_chw(torch.from_numpy(x).permute(2, 0, 1), hw)
        return len(self.work)

    def close(self) -> None:
        self.work = []


class Loader:
    """Any DataLoader-like iterable of batches whose ``field`` is a uint8 image batch."""

    def __init__(self, loader: Any, field: str) -> None:
        self.loader, self.field = loader, field
        self.epoch()  # warm-up: workers started, shards staged, page cache filled

    def epoch(self) -> int:
        seen = 0
        for batch in self.loader:
            x = batch[self.field] if isinstance(batch, dict) else batch[0]
            assert x.dtype == torch.uint8 and tuple(x.shape[-2:]) == (SIZE, SIZE), x.shape
            seen += len(x)
        return seen

    def close(self) -> None:
        del self.loader


def _dl_kwargs(workers: int) -> dict[str, Any]:
    # the same start method for everyone: an imported peer may switch the default to spawn
    return dict(
        num_workers=workers,
        persistent_workers=True,
        prefetch_factor=4,
        multiprocessing_context=multiprocessing.get_context("fork"),
    )


def shardloader_runner(packed: str, workers: int, transform: Any, shuffle: bool) -> Loader:
    ds = sl.ShardedDataset(
        packed,
        batch_size=BATCH,
        shuffle=shuffle,
        decoder=sl.Decoder(image="raw"),
        transform=transform,
        uneven="drop",
    )
    return Loader(sl.make_loader(ds, **_dl_kwargs(workers)), "image")


class PeerTransform:
    """torchvision's fastest CPU train pipeline on JPEG bytes: decode_jpeg (libjpeg-turbo) to a
    uint8 CHW tensor, v2.RandomResizedCrop(224, antialias) and v2.RandomHorizontalFlip."""

    def __init__(self) -> None:
        from torchvision.transforms import v2

        self.t = v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()])

    def __call__(self, data: bytes) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg

        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return self.t(decode_jpeg(raw, mode=ImageReadMode.RGB))


def _stack(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in batch]), torch.tensor([y for _, y in batch])


class _BytesFolder(torch.utils.data.Dataset):
    def __init__(self, files: list[tuple[str, int]], transform: Any) -> None:
        self.files, self.transform = files, transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[i]
        with open(path, "rb") as f:
            return self.transform(f.read()), label


def imagefolder_runner(root: str, files: list[tuple[str, int]], workers: int, pil: bool) -> Loader:
    from torch.utils.data import DataLoader

    if pil:  # torchvision's defaults: PIL loader, PIL resize, then to a uint8 tensor
        from torchvision.datasets import ImageFolder
        from torchvision.transforms import v2

        t = v2.Compose([v2.RandomResizedCrop(SIZE), v2.RandomHorizontalFlip(), v2.PILToTensor()])
        ds: Any = ImageFolder(root, transform=t)
    else:
        ds = _BytesFolder(files, PeerTransform())
    kw = _dl_kwargs(workers)
    return Loader(DataLoader(ds, BATCH, shuffle=True, collate_fn=_stack, **kw), "image")


def webdataset_runner(work: str, workers: int) -> Loader:
    import webdataset as wds
    from torch.utils.data import DataLoader

    out = os.path.join(work, "wds")
    os.makedirs(out)
    per_shard = max(1, len(_IMAGES) // 16)
    with wds.ShardWriter(os.path.join(out, "s-%05d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, data in enumerate(_IMAGES):
            sink.write({"__key__": f"{i:06d}", "jpg": data, "cls": i % 10})
    urls = sorted(os.path.join(out, f) for f in os.listdir(out))
    ds = (
        wds.WebDataset(
            urls, shardshuffle=len(urls), workersplitter=wds.split_by_worker, empty_check=False
        )
        .shuffle(1000)
        .map(_PeerSample())
        .batched(BATCH, collation_fn=_stack)
    )
    return Loader(DataLoader(ds, batch_size=None, **_dl_kwargs(workers)), "image")


def _litdata_item(item: tuple[int, bytes]) -> dict[str, Any]:
    return {"jpg": item[1], "cls": item[0] % 10}  # optimize() may spawn: the bytes travel


class _PeerSample:
    def __init__(self) -> None:
        self.t = PeerTransform()

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        return self.t(sample["jpg"]), int(sample["cls"])


def litdata_runner(work: str, workers: int) -> Loader:
    from litdata import StreamingDataLoader, StreamingDataset, optimize

    out = os.path.join(work, "litdata")
    optimize(
        fn=_litdata_item,
        inputs=list(enumerate(_IMAGES)),
        output_dir=out,
        chunk_bytes="64MB",
        num_workers=1,
        mode="overwrite",
    )
    ds = StreamingDataset(out, shuffle=True, transform=_PeerSample())
    kw = _dl_kwargs(workers)
    kw.pop("multiprocessing_context")  # StreamingDataLoader picks its own
    return Loader(StreamingDataLoader(ds, batch_size=BATCH, collate_fn=_stack, **kw), "image")


def mosaic_runner(work: str, workers: int) -> Loader:
    for name in ("streaming.vision", "streaming.multimodal", "streaming.text"):
        sys.modules.setdefault(name, types.ModuleType(name))  # not needed, heavy imports
    from streaming.base import MDSWriter, StreamingDataset
    from torch.utils.data import DataLoader

    out = os.path.join(work, "mds")
    with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}, size_limit="64mb") as w:
        for i, data in enumerate(_IMAGES):
            w.write({"jpg": data, "cls": i % 10})

    class Mosaic(StreamingDataset):
        def __init__(self) -> None:
            super().__init__(local=out, shuffle=True, batch_size=BATCH)
            self.t = _PeerSample()

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return self.t(super().__getitem__(i))

    return Loader(DataLoader(Mosaic(), BATCH, collate_fn=_stack, **_dl_kwargs(workers)), "image")


# ----------------------------------------------------------------------------------- measuring


def _cpu_seconds() -> float:
    """CPU time of this process and its children (pools, DataLoader workers), alive or
    joined (cputree.py)."""
    return tree_cpu()


def interleaved(runners: dict[str, Any], reps: int) -> dict[str, tuple[float, float]]:
    """Per runner: median wall images/s and median CPU ms per image, runners taking turns so
    load from elsewhere on the machine hits all alike."""
    walls: dict[str, list[float]] = {name: [] for name in runners}
    cpus: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(reps):
        for name, runner in runners.items():
            t0, c0 = time.perf_counter(), _cpu_seconds()
            n = runner.epoch()
            wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
            walls[name].append(n / wall)
            cpus[name].append(1e3 * cpu / n)
    for runner in runners.values():
        runner.close()
    return {n: (statistics.median(walls[n]), statistics.median(cpus[n])) for n in runners}


def stages(sample: int = 300) -> dict[str, dict[str, float]]:
    """Single-process CPU ms/image by stage, before (PIL: decode whole image, crop, resize,
    flip, copy) and after (native: header, crop decode incl. flip, resize, copy)."""
    images = _IMAGES[:sample]
    out: dict[str, dict[str, float]] = {"PIL path (before)": {}, "native path (after)": {}}

    def timed(table: str, name: str, fn: Callable[[], Any]) -> None:
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        out[table][name] = 1e3 * best / len(images)

    rrc = vision.RandomResizedCrop(SIZE)
    boxes = [
        rrc.params(*Image.open(io.BytesIO(d)).size, generator=torch.Generator().manual_seed(i))
        for i, d in enumerate(images)
    ]
    hw = (SIZE, SIZE)
    for table, backend in (("PIL path (before)", "pil"), ("native path (after)", "auto")):
        srcs = [Encoded(d, backend) for d in images]
        wanted = [jpeg.request(s.size, b, hw) for s, b in zip(srcs, boxes, strict=True)]
        timed(table, "header", lambda b=backend: [Encoded(d, b) for d in images])
        crops = [
            crop(Encoded(d, backend), b, w) for d, b, w in zip(images, boxes, wanted, strict=True)
        ]
        timed(
            table,
            "header + decode box (drafted)",
            lambda b=backend, ws=wanted: [
                crop(Encoded(d, b), x, w) for d, x, w in zip(images, boxes, ws, strict=True)
            ],
        )
        outs = [resize_chw(c, hw) for c in crops]
        timed(table, "resize (resize_chw)", lambda c=crops: [resize_chw(x, hw) for x in c])
        timed(table, "flip (separate copy)", lambda o=outs: [x.flip(-1) for x in o])
        timed(table, "contiguous CHW copy", lambda o=outs: [vision.ToImageTensor()(x) for x in o])
        t = vision.train_transform(SIZE, field=None, backend=backend)
        timed(
            table,
            "whole train transform",
            lambda t=t: [
                t(d, generator=torch.Generator().manual_seed(i)) for i, d in enumerate(images)
            ],
        )
    return out


def runners_for(work: str, files: list[tuple[str, int]], w: int, peers: bool) -> dict[str, Any]:
    """name -> a function starting that runner (started only if selected)."""
    packed, folders = os.path.join(work, "packed"), os.path.join(work, "folders")
    train, eval_ = vision.train_transform(SIZE), vision.eval_transform(SIZE)
    make: dict[str, Callable[[], Any]] = {
        "bare decode, PIL": _later(BareDecode, w, "pil"),
        "shardloader train": _later(shardloader_runner, packed, w, train, True),
        "shardloader train, PIL backend": _later(
            shardloader_runner, packed, w, vision.train_transform(SIZE, backend="pil"), True
        ),
        "shardloader eval": _later(shardloader_runner, packed, w, eval_, False),
    }
    if jpeg.native_reason() is None:
        make["bare decode, libjpeg-turbo"] = _later(BareDecode, w, "native")
        make[FLOOR] = BareOps
    if not peers:
        return make
    make["ImageFolder + torchvision (PIL)"] = _later(imagefolder_runner, folders, files, w, True)
    make[PEER] = _later(imagefolder_runner, folders, files, w, False)
    for name, module, fn in (
        ("webdataset", "webdataset", webdataset_runner),
        ("LitData", "litdata", litdata_runner),
        ("MosaicML", "streaming", mosaic_runner),
    ):
        try:
            __import__(module)
        except ImportError:
            print(f"{name} not installed: skipped")
            continue
        make[f"{name} + torchvision (decode_jpeg)"] = _later(fn, work, w)
    return make


def measure(args: argparse.Namespace, width: int, height: int, peers: bool) -> tuple:
    _IMAGES[:] = make_jpegs(args.images, width, height, seed=0)
    kb = sum(map(len, _IMAGES)) / len(_IMAGES) / 1024
    only = set(filter(None, (n.strip() for n in args.only.split(";"))))
    work = tempfile.mkdtemp(prefix="bv-")
    try:
        files = write_folders(os.path.join(work, "folders"))
        options = PackOptions(max_samples=len(_IMAGES) // 16 + 1)
        pack(os.path.join(work, "folders"), os.path.join(work, "packed"), options)
        os.environ["SHARDLOADER_CACHE_DIR"] = os.path.join(work, "cache")
        make = runners_for(work, files, args.workers, peers)
        runners = {name: fn() for name, fn in make.items() if not only or name in only}
        best = interleaved(runners, args.reps)
        return f"{width}x{height} ({kb:.0f} KB)", best, stages()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    try:
        import torchvision  # noqa: F401

        peers = True
    except ImportError:
        peers = False
        print("torchvision not installed: peers skipped (use /work/main/.venv-bench)")
    print(f"native JPEG decoder: {jpeg.native_reason() or 'built'}; load before {_load()}")
    tables = []
    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.lower().split("x"))
        tables.append(measure(args, width, height, peers))
    print(
        f"load after {_load()} ({os.cpu_count()} cores); {args.images} images, "
        f"{args.workers} workers/processes, medians of {args.reps}"
    )
    for title, best, st in tables:
        report(title, best, st)
    if args.json:
        import json

        out = {
            "load": os.getloadavg(),
            "workers": args.workers,
            "images": args.images,
            "tables": [
                {
                    "size": title,
                    "runners": {n: {"img_s": w, "cpu_ms": c} for n, (w, c) in b.items()},
                }
                for title, b, _ in tables
            ],
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def _later(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def report(
    title: str, best: dict[str, tuple[float, float]], st: dict[str, dict[str, float]]
) -> None:
    pil = best.get("bare decode, PIL", (float("nan"), float("nan")))
    nat = best.get("bare decode, libjpeg-turbo", (float("nan"), float("nan")))
    print(f"\n### {title}\n")
    header = ("runner", "img/s", "CPU ms/img", "÷ PIL bare decode", "÷ libjpeg-turbo bare decode")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, (wall, cpu) in best.items():
        print(f"| {name} | {wall:.0f} | {cpu:.2f} | {wall / pil[0]:.2f} | {wall / nat[0]:.2f} |")
    peers = {n: v for n, v in best.items() if "torchvision" in n}
    ours = best.get("shardloader train")
    print()
    if ours:
        print(
            f"- train / bare decode: {ours[0] / pil[0]:.2f} (PIL), {ours[0] / nat[0]:.2f} "
            f"(libjpeg-turbo); by CPU time {pil[1] / ours[1]:.2f}, {nat[1] / ours[1]:.2f}"
        )
        if peers:
            name, (wall, cpu) = max(peers.items(), key=lambda kv: kv[1][0])
            print(
                f"- train / best peer ({name}): {ours[0] / wall:.2f} (wall), "
                f"{cpu / ours[1]:.2f} (CPU)"
            )
    floor = best.get(FLOOR)
    if ours and floor:
        print(
            "- train CPU / bare ops (decode of the box + resize, 1 process): "
            f"{ours[1] / floor[1]:.2f}"
        )
    ev = best.get("shardloader eval")
    if ev:
        print(f"- eval / bare decode: {ev[0] / pil[0]:.2f} (PIL), {ev[0] / nat[0]:.2f} (native)")
    print("\nsingle process, CPU ms/image by stage:\n")
    names = list(next(iter(st.values())))
    print("| path | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 1))
    for path, row in st.items():
        print(f"| {path} | " + " | ".join(f"{row[n]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()
