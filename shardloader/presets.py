"""A dataset described by plain values: what ``shardloader serve DATASET`` and ``shardloader
bench DATASET`` build from their flags.

Both commands turn the same names (a built-in transform, how images decode, the node cache,
storage options, retries) into the same reader, decoder and transform here, so a dataset served
and a dataset benchmarked with the same flags run the same pipeline.  ``--transform train``
builds the *Vision* recipe: ``Decoder(image="raw")`` and :func:`shardloader.vision.
train_transform`, which decodes JPEGs at reduced scale itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

# NOTE: the CLI imports this module to declare its options, before any command runs: keep its
# top-level imports light (no torch, numpy, pyarrow, fsspec; tests/test_cli_imports.py).
from shardloader.errors import UsageError

if TYPE_CHECKING:
    from shardloader.codecs.allowlist import Decoder
    from shardloader.dataset import ShardedDataset
    from shardloader.read.shardset import ReadOptions
    from shardloader.storage.retry import RetryPolicy

__all__ = ["IMAGE_DECODES", "TRANSFORMS", "DatasetPreset"]

TRANSFORMS = ("auto", "train", "eval", "none")  # auto: train when the dataset has an image field
IMAGE_DECODES = ("tensor", "numpy", "raw")

Transform = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class DatasetPreset:
    """How to read a packed dataset, by name; :meth:`dataset` builds it.

    ``decode`` says how image fields decode when no transform runs (a transform decodes the
    raw bytes itself); ``image_field`` is the field the transform applies to (default
    ``image``, which class-folder packs hold, else the first image field).
    """

    batch_size: int | None = None
    shuffle: bool = False
    seed: int = 0
    uneven: str = "pad"
    decode: str = "tensor"
    transform: str = "auto"  # as serve and bench default: train where there are images
    image_size: int = 224
    image_field: str | None = None
    cache_dir: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    retry: RetryPolicy | None = None  # None: the library's default policy
    fill: Mapping[str, Any] = field(default_factory=dict)  # Decoder(fill=...): --fill
    required: tuple[str, ...] = ()  # Decoder(required=...): --require

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise UsageError(
                f"--transform {self.transform!r}: choose one of {', '.join(TRANSFORMS)}"
            )
        if self.decode not in IMAGE_DECODES:
            raise UsageError(f"--decode {self.decode!r}: choose one of {', '.join(IMAGE_DECODES)}")
        if self.image_size < 1:
            raise UsageError(f"--image-size {self.image_size} must be >= 1")
        if self.image_field is not None and self.transform == "none":
            raise UsageError("--image-field applies with --transform train/eval/auto only")

    def read_options(self) -> ReadOptions:
        """Storage options, the node cache folder and the retry policy, as the reader takes them."""
        from shardloader.read.shardset import ReadOptions
        from shardloader.storage.cache import CacheOptions

        read = ReadOptions(
            storage_options=dict(self.storage_options), cache=CacheOptions(dir=self.cache_dir)
        )
        return read if self.retry is None else replace(read, retry=self.retry)

    def pipeline(self, url: str) -> tuple[Decoder, Transform | None]:
        """The (decoder, transform) for the dataset at ``url`` (its manifest is read only for a
        transform, to find the image field), with ``fill`` and ``required`` on the decoder."""
        from shardloader.codecs.allowlist import Decoder

        transform = None if self.transform == "none" else self._transform(url)
        image = self.decode if transform is None else "raw"
        return Decoder(image=image, fill=dict(self.fill), required=self.required), transform

    def _transform(self, url: str) -> Transform | None:
        """The image transform (None: ``auto`` on a dataset without an image field)."""
        from shardloader import vision
        from shardloader.manifest import read_manifest

        manifest, _ = read_manifest(self.read_options().store(url))
        name = self.image_field or vision.image_field(manifest.fields)
        if name is None or name not in manifest.fields:
            if self.transform == "auto" and self.image_field is None:
                return None
            which = f" {self.image_field!r}" if self.image_field else ""
            raise UsageError(
                f"--transform {self.transform}: {url} has no image field{which} "
                f"(fields: {', '.join(manifest.fields)})"
            )
        make = vision.eval_transform if self.transform == "eval" else vision.train_transform
        return make(self.image_size, field=name)

    def dataset(self, url: str, **overrides: Any) -> ShardedDataset:
        """The :class:`ShardedDataset` at ``url`` as this preset describes it; ``overrides``
        are further ShardedDataset arguments (``world``, ``collate_fn``...)."""
        from shardloader.dataset import ShardedDataset

        decoder, transform = self.pipeline(url)
        kwargs: dict[str, Any] = dict(
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            uneven=self.uneven,
            decoder=decoder,
            transform=transform,
            read=self.read_options(),
        )
        if self.required:  # --require skips what lacks the field (and other bad samples)
            kwargs["on_error"] = "skip"
        kwargs.update(overrides)
        return ShardedDataset(url, **kwargs)
