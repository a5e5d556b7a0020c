"""GPU figures for ``tools/device_check.sh``: decoding on the device against decoding on the CPU,
and how long a batch takes from a worker to the GPU, pinned or not.

    python tools/bench_device.py [--images 2000] [--workers 4] [--json PATH]

Both parts need torch with a CUDA device and torchvision; without them each part prints
``skipped: <reason>`` (and ``--json`` records the reason), and the tool exits 0, so the script
runs on a CPU machine too.  ``--device cpu`` runs the same code on the CPU (a smoke test of the
tool, not a figure).

* **decode**: the same generated JPEGs (``tools/bench_vision.py``'s, 500x375, quality 90),
  packed once uncompressed; an epoch of uint8 224x224 batches of 64 through ``make_loader``
  with ``--workers`` workers, either ``vision.train_transform(224)`` on the CPU (the crop
  decoded alone, in the workers) or ``vision.gpu.CropPlan(224)`` in the workers and
  ``vision.gpu.DeviceDecode(224)`` in the training process (nvJPEG through torchvision), plus
  a bare ``torchvision.io.decode_jpeg`` of every image on the device, a batch at a time.  Images/s
  (wall, the device synchronised at the end) and CPU ms per image of the whole process tree.
* **hand-over**: the CPU pipeline's batches (9.6 MB each) with ``pin_memory`` on and off:
  per batch, the time the loop waits for the next batch, and the time of
  ``.to("cuda", non_blocking=True)`` until the copy is done (the stream synchronised).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH, SIZE = 64, 224


def missing() -> str | None:
    """Why the GPU parts cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return "torchvision is not installed (DeviceDecode needs torchvision.io.decode_jpeg)"
    return None


def _dataset(path: str, transform: Any, collate: Any = None) -> Any:
    import shardloader as sl

    return sl.ShardedDataset(
        path,
        batch_size=BATCH,
        shuffle=True,
        decoder=sl.Decoder(image="raw"),
        transform=transform,
        collate_fn=collate,
        uneven="drop",
    )


def _loader(ds: Any, workers: int, pin: bool = False) -> Any:
    import shardloader as sl

    kw: dict[str, Any] = {"num_workers": workers, "pin_memory": pin}
    if workers:
        kw.update(prefetch_factor=4, multiprocessing_context="fork")
    return sl.make_loader(ds, **kw)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode(packed: str, images: list[bytes], workers: int, device: str) -> dict[str, Any]:
    import torch
    from cputree import TreeCPU
    from torchvision.io import ImageReadMode, decode_jpeg

    import shardloader as sl
    from shardloader import vision
    from shardloader.vision import gpu

    out: dict[str, Any] = {}
    on_device = gpu.DeviceDecode(SIZE, device=device)
    runs = {
        "CPU: train_transform in the workers": (
            _dataset(packed, vision.train_transform(SIZE)),
            lambda b: b["image"],
        ),
        "GPU: CropPlan in the workers, DeviceDecode": (
            _dataset(packed, gpu.CropPlan(SIZE), sl.RawCollate()),
            on_device,
        ),
    }
    for name, (ds, finish) in runs.items():
        loader = _loader(ds, workers)
        for batch in loader:  # warm-up: shards staged, CUDA and nvJPEG initialised
            finish(batch)
        _sync(device)
        walls, cpus = [], []
        for _ in range(3):
            n = 0
            with TreeCPU() as cpu:
                t0 = time.perf_counter()
                for batch in loader:
                    n += len(finish(batch))
                _sync(device)
                wall = time.perf_counter() - t0
            walls.append(n / wall)
            cpus.append(cpu.seconds / n * 1e3)
        out[name] = {"img_s": statistics.median(walls), "cpu_ms_per_image": statistics.median(cpus)}
        _say(name, out[name])
    raw = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in images]
    decode_jpeg(raw[:BATCH], mode=ImageReadMode.RGB, device=device)
    _sync(device)
    with TreeCPU() as cpu:
        t0 = time.perf_counter()
        for i in range(0, len(raw), BATCH):
            decode_jpeg(raw[i : i + BATCH], mode=ImageReadMode.RGB, device=device)
        _sync(device)
        wall = time.perf_counter() - t0
    name = "bare decode_jpeg on the device (whole images, one process)"
    out[name] = {"img_s": len(raw) / wall, "cpu_ms_per_image": cpu.seconds / len(raw) * 1e3}
    _say(name, out[name])
    return out


def _say(name: str, r: dict[str, float]) -> None:
    print(f"  {name}: {r['img_s']:,.0f} img/s, {r['cpu_ms_per_image']:.2f} CPU ms/img")


def handover(packed: str, workers: int, device: str) -> dict[str, Any]:
    from shardloader import vision

    out: dict[str, Any] = {}
    for pin in (True, False) if device.startswith("cuda") else (False,):
        loader = _loader(_dataset(packed, vision.train_transform(SIZE)), workers, pin)
        for _ in loader:  # warm-up
            pass
        waits, copies, pinned = [], [], []
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            t1 = time.perf_counter()
            x = batch["image"]
            pinned.append(x.is_pinned())
            y = x.to(device, non_blocking=True)
            _sync(device)
            t2 = time.perf_counter()
            del y
            waits.append(t1 - t0)
            copies.append(t2 - t1)
        name = f"pin_memory={pin}"
        out[name] = {
            "batches": len(copies),
            "batch_mb": BATCH * 3 * SIZE * SIZE / 1e6,
            "wait_ms": statistics.median(waits) * 1e3,
            "to_gpu_ms": statistics.median(copies) * 1e3,
            "pinned": all(pinned),
        }
        r = out[name]
        print(
            f"  {name}: next() waits {r['wait_ms']:.2f} ms, .to({device!r}) "
            f"{r['to_gpu_ms']:.2f} ms a {r['batch_mb']:.1f} MB batch "
            f"({r['batch_mb'] / r['to_gpu_ms']:.1f} GB/s), "
            f"pinned: {r['pinned']}"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--json", help="write the figures (or the skip reasons) here")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this tool")
    args = ap.parse_args()
    result: dict[str, Any] = {"load": os.getloadavg(), "cores": os.cpu_count()}
    reason = missing() if args.device.startswith("cuda") else None
    if reason is not None:
        for part in ("GPU decode against CPU decode", "pinned-memory hand-over"):
            print(f"{part}: skipped: {reason}")
        result["skipped"] = reason
    else:
        import torch
        from bench_vision import make_jpegs

        from shardloader.pack import PackOptions, pack

        cuda = args.device.startswith("cuda")
        result["device"] = torch.cuda.get_device_name() if cuda else args.device
        images = make_jpegs(args.images, 500, 375, seed=0)
        with tempfile.TemporaryDirectory(prefix="device-check-") as work:
            os.environ.setdefault("SHARDLOADER_CACHE_DIR", os.path.join(work, "cache"))
            folders = os.path.join(work, "folders")
            for i, data in enumerate(images):
                os.makedirs(os.path.join(folders, f"c{i % 10}"), exist_ok=True)
                with open(os.path.join(folders, f"c{i % 10}", f"{i:06d}.jpg"), "wb") as f:
                    f.write(data)
            packed = os.path.join(work, "packed")
            pack(folders, packed, PackOptions(compression="none", max_samples=256))
            print(f"GPU decode against CPU decode ({args.images} JPEGs, {args.workers} workers):")
            result["decode"] = decode(packed, images, args.workers, args.device)
            print(f"pinned-memory hand-over ({args.workers} workers):")
            result["handover"] = handover(packed, args.workers, args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
