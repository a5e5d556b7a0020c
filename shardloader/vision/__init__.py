"""Vision: image decoding, the standard train/eval transforms and a detection collate, without
torchvision.

* :mod:`~shardloader.vision.image`: decoding only the crop, crops and the fast resize;
* ``vision.jpeg``: the crop-aware JPEG decoder over libjpeg-turbo, a codec
  (:mod:`shardloader.codecs.jpeg`, named here too);
* :mod:`~shardloader.vision.transforms`: :class:`RandomResizedCrop`, :func:`train_transform`,
  ... (seeded per batch by the dataset: NOTE [transform generators] there);
* :mod:`~shardloader.vision.collate`: :class:`DetectionCollate`.

This file only re-exports.
"""

from shardloader.codecs import jpeg
from shardloader.vision.collate import DetectionCollate
from shardloader.vision.image import decode_image, open_image
from shardloader.vision.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ApplyTo,
    CenterCrop,
    Compose,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ResizeCenterCrop,
    ToImageTensor,
    eval_transform,
    image_field,
    train_transform,
)

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "decode_image",
    "open_image",
    "RandomResizedCrop",
    "RandomHorizontalFlip",
    "Resize",
    "CenterCrop",
    "ResizeCenterCrop",
    "ToImageTensor",
    "Normalize",
    "Compose",
    "ApplyTo",
    "DetectionCollate",
    "train_transform",
    "eval_transform",
    "image_field",
    "jpeg",
]
