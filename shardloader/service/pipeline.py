"""What ``shardloader serve PIPELINE`` serves: a ``module:factory`` dataset, or a dataset path
configured by the command's options; and the bearer token file.  Nothing a client sends is ever
run: PIPELINE comes from the command line of the serving machine.
"""

from __future__ import annotations

import os
import re
from typing import Any

from shardloader.errors import UsageError

__all__ = ["DATASET_OPTIONS", "is_factory", "load_pipeline", "read_token"]

_FACTORY = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
DATASET_OPTIONS = ("batch_size", "shuffle", "seed", "uneven", "decode", "transform",
                   "image_size", "image_field", "cache_dir")


def is_factory(pipeline: str) -> bool:
    """Whether PIPELINE names ``package.module:factory`` (and is not an existing path)."""
    return bool(_FACTORY.match(pipeline)) and not os.path.exists(pipeline)


def read_token(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped); never empty."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"--token-file {path}: cannot read it ({err})") from err
    if len(token) < 16 or any(c.isspace() for c in token):
        raise UsageError(f"--token-file {path}: the token must be one word of at least 16 "
                         "characters, e.g. from `python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))'`")
    return token


def load_pipeline(pipeline: str, **options: Any) -> Any:
    """The dataset PIPELINE names: a ``module:factory`` result, or a dataset path configured
    by ``options`` (batch_size, shuffle, seed, uneven, decode, transform, image_size,
    image_field, cache_dir)."""
    from shardloader.dataset import ShardedDataset

    if is_factory(pipeline):
        import importlib

        module_name, _, attr = pipeline.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
        except ImportError as err:
            raise UsageError(f"PIPELINE {pipeline}: cannot import {module_name} ({err}); is it "
                             "installed or on PYTHONPATH on this machine?") from err
        for part in attr.split("."):
            if not hasattr(target, part):
                raise UsageError(f"PIPELINE {pipeline}: {module_name} has no {attr!r}")
            target = getattr(target, part)
        dataset = target
        if callable(target) and not isinstance(target, ShardedDataset):
            import inspect

            try:
                inspect.signature(target).bind()
            except TypeError as err:
                raise UsageError(f"PIPELINE {pipeline}: the factory must be callable without "
                                 f"arguments ({err})") from err
            except ValueError:  # no signature to inspect (builtins): just call it
                pass
            dataset = target()
        if not isinstance(dataset, ShardedDataset):
            raise UsageError(f"PIPELINE {pipeline} gave a {type(dataset).__name__}; the factory "
                             "must return a shardloader.ShardedDataset")
        return dataset
    return _dataset_from_path(pipeline, **options)


def _dataset_from_path(url: str, *, batch_size: int | None, shuffle: bool, seed: int,
                       uneven: str, decode: str, transform: str, image_size: int,
                       image_field: str | None, cache_dir: str | None) -> Any:
    from shardloader.codecs import Decoder
    from shardloader.dataset import ShardedDataset
    from shardloader.shards import ReadOptions
    from shardloader.storage.cache import CacheOptions

    read = ReadOptions(cache=CacheOptions(dir=cache_dir))
    transform_fn = None
    if transform != "none":
        from shardloader import vision
        from shardloader.manifest import read_manifest

        manifest, _ = read_manifest(url, read.storage_options)
        field = image_field or vision.image_field(manifest.fields)  # "image": class folders
        if field is None or field not in manifest.fields:
            raise UsageError(f"--transform {transform}: {url} has no image field "
                             f"{image_field or ''} (fields: {', '.join(manifest.fields)})")
        make = vision.train_transform if transform == "train" else vision.eval_transform
        transform_fn = make(image_size, field=field)
        decode = "raw"  # the transforms decode at reduced scale themselves
    elif image_field is not None:
        raise UsageError("--image-field applies with --transform train/eval only")
    return ShardedDataset(url, batch_size=batch_size, shuffle=shuffle, seed=seed, uneven=uneven,
                          transform=transform_fn, decoder=Decoder(image=decode), read=read,
                          rank=0, world_size=1)
