"""Train a tiny CNN on a packed class-folder image dataset, on the CPU, and say who waits.

    shardloader pack photos/ packed/            # photos/<class>/<image>.jpg|.jpeg|.png|...
    python tools/train_image.py packed/ --steps 50 --workers 2
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tools/train_image.py packed/ --steps 50    # DDP over gloo, one shard of batches per rank
    python tools/train_image.py --remote http://host:8000 --num-classes 10   # shardloader serve

Images (any mix of formats and modes: a class-folder pack holds them all in the field
``image``, converted to RGB) are decoded in the DataLoader workers at reduced JPEG scale and
augmented there (``shardloader.vision.train_transform``); normalization runs on the whole batch
in the loop.
``shardloader.monitor`` times the wait for each batch against the step and the script ends by
printing the data-bound share (over all ranks under torchrun).
"""

from __future__ import annotations

import argparse
import gc
import io
import logging
import os
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import shardloader as sl
from shardloader.deliver.monitor import all_ranks, monitor

log = logging.getLogger("train_image")


class SimpleResize:
    """Fallback transform when ``shardloader.vision`` is missing: decode, resize, uint8 CHW."""

    def __init__(self, field: str, size: int) -> None:
        self.field, self.size = field, size

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        from PIL import Image

        with Image.open(io.BytesIO(sample[self.field])) as im:
            pixels = np.asarray(im.convert("RGB").resize((self.size, self.size)))
        return {**sample, self.field: torch.from_numpy(pixels.copy()).permute(2, 0, 1)}


def transform_for(field: str, size: int) -> Any:
    try:
        from shardloader.vision import train_transform
    except ImportError:
        return SimpleResize(field, size)
    return train_transform(size, scale=(0.35, 1.0), field=field)


def normalize(x: torch.Tensor) -> torch.Tensor:
    try:
        from shardloader.vision import Normalize
    except ImportError:
        return x.float() / 127.5 - 1.0
    return Normalize()(x)


class TinyCNN(nn.Module):
    def __init__(self, num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def image_field(batch: dict[str, Any]) -> str:
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim == 4:
            return key
    raise SystemExit(f"no image field (a 4-D tensor) in the batch; fields: {', '.join(batch)}")


def setup_distributed() -> tuple[int, int]:
    """gloo process group under torchrun (WORLD_SIZE > 1), else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def make_loader(args: argparse.Namespace, rank: int, world: int) -> tuple[Any, Any, int]:
    """(loader, dataset or None, number of classes)."""
    if args.remote:
        try:
            from shardloader.service.client import RemoteLoader
        except ImportError as err:
            raise SystemExit(
                f"--remote needs the service client ({err}); pip install 'shardloader[serve]'"
            ) from err
        if not args.num_classes:
            raise SystemExit("--remote needs --num-classes (the model is built before any batch)")
        remote = RemoteLoader(args.remote, world=sl.World(rank, world), seed=args.seed)
        return remote, None, args.num_classes
    if not args.data:
        raise SystemExit("give DATA (a packed dataset) or --remote URL")
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=args.cache_dir)) if args.cache_dir else None
    manifest, _ = sl.read_manifest(args.data)
    images = sorted(name for name, info in manifest.fields.items() if info.codec == "image")
    if "image" in images:  # class-folder packs: every extension of the folder, one field
        images.insert(0, "image")
    if not images or "cls" not in manifest.fields:
        raise SystemExit(
            f"{args.data} is not a packed class-folder dataset (fields: "
            f"{', '.join(manifest.fields)}); pack a folder of <class>/<image> files"
        )
    classes = args.num_classes or len(manifest.classes)
    if classes < 1:
        raise SystemExit(f"{args.data} records no classes; pass --num-classes")
    ds = sl.ShardedDataset(
        args.data,
        batch_size=args.batch_size,
        shuffle=True,
        seed=args.seed,
        decoder=sl.Decoder(image="raw"),
        transform=transform_for(images[0], args.size),
        read=read,
    )
    loader = sl.make_loader(ds, num_workers=args.workers)
    return loader, ds, classes


def train(args: argparse.Namespace) -> int:
    rank, world = setup_distributed()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank {rank}] %(message)s"
    )
    loader, ds, classes = make_loader(args, rank, world)
    model: nn.Module = TinyCNN(classes)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    timed = monitor(loader, interval=args.log_every)
    step = epoch = 0
    field = None
    epochs = ds if ds is not None else loader  # both have set_epoch
    while step < args.steps:
        epochs.set_epoch(epoch)
        for batch in timed:
            field = field or image_field(batch)
            x, y = normalize(batch[field]), torch.as_tensor(batch["cls"])
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and (step % args.log_every == 0 or step == args.steps):
                print(f"step {step} epoch {epoch} loss {loss.item():.4f}", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    total = all_ranks(timed.stats())
    if rank == 0:
        where = f" (all {world} ranks)" if world > 1 else ""
        print(f"{total.summary()}{where}", flush=True)
        print(f"reading: {total.advice}", flush=True)
    if world > 1:
        # Free DDP's reducer (it holds the process group) and let gloo's threads finish
        # while the group lives: destroying the group from the reducer at exit deadlocks
        # (its destructor waits, holding the GIL, on a gloo thread that needs the GIL).
        model = None
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", nargs="?", help="packed class-folder dataset (folder or URL)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader num_workers per rank")
    p.add_argument("--size", type=int, default=32, help="training image side, pixels")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="steps between reports")
    p.add_argument("--num-classes", type=int, default=0, help="default: from the manifest")
    p.add_argument("--cache-dir", default=None, help="node cache for staged shards")
    p.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="read batches from `shardloader serve` at URL instead of DATA",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.workers < 0 or args.log_every < 1:
        p.error("--steps, --batch-size and --log-every must be >= 1, --workers >= 0")
    return args


if __name__ == "__main__":
    sys.exit(train(parse()))
