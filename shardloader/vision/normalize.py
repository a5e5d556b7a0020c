"""``Normalize``: uint8 (or [0, 1] float) images to normalized floats, on the batch, on the
accelerator; and the ImageNet mean and std it defaults to.

A module of its own because it is the one vision step that runs outside the workers (on the
batch in the training loop), and the one that checks its input's range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardloader.errors import UsageError

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "Normalize", "as_numbers"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def as_numbers(name: str, values: Any, n: int | None = None) -> tuple[float, ...]:
    """``values`` as floats, or a UsageError naming the option (not float()'s ValueError)."""
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{name} must be numbers, got {values!r}") from err
    if n is not None and len(out) != n:
        raise UsageError(f"{name} must be {n} numbers, got {values!r}")
    return out


_FLOAT_MAX = 1.5  # float images are in [0, 1]; a little above is rounding, 2+ is 0-255 data


@dataclass(frozen=True)
class Normalize:
    """``(x / 255 - mean) / std`` for uint8 input, ``(x - mean) / std`` for float input (taken
    as already in [0, 1]); works on one image or a batch, on any device, in ``dtype``.

    Float input above 1 (0–255 pixels cast to float, the mistake the Troubleshooting page
    describes) is refused: checked on every CPU tensor, and on the first tensor of another
    device only (reading a value back from an accelerator waits for it).
    """

    mean: Sequence[float] = IMAGENET_MEAN
    std: Sequence[float] = IMAGENET_STD
    channels_last: bool = False  # channel dimension last (HWC / NHWC) instead of -3
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", as_numbers("mean", self.mean))
        object.__setattr__(self, "std", as_numbers("std", self.std))
        if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
            raise UsageError(f"mean {self.mean} and std {self.std} need equal lengths, std > 0")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise UsageError(
                f"Normalize takes a tensor, got {type(x).__name__}; ToImageTensor first"
            )
        if (
            x.is_floating_point()
            and x.numel()
            and (x.device.type == "cpu" or not self.__dict__.get("_checked"))
        ):
            object.__setattr__(self, "_checked", True)  # not a field: equality stays
            top = float(x.detach().amax())
            if top > _FLOAT_MAX:
                raise UsageError(
                    f"Normalize got a float tensor with values up to {top:g}: float images "
                    "must be in [0, 1]; pass the uint8 tensor (0-255) as it is, or divide by "
                    "255 first"
                )
        shape = (-1,) if self.channels_last else (-1, 1, 1)
        mean = torch.tensor(self.mean, dtype=self.dtype, device=x.device).view(shape)
        std = torch.tensor(self.std, dtype=self.dtype, device=x.device).view(shape)
        y = x.to(self.dtype)
        if x.dtype == torch.uint8:
            y = y / 255
        try:
            return (y - mean) / std
        except RuntimeError as err:  # the shapes do not broadcast
            where = "last" if self.channels_last else "third from last"
            raise UsageError(
                f"Normalize has {len(self.mean)} channels (mean/std) but a tensor of shape "
                f"{tuple(x.shape)}, channels expected at the {where} dimension "
                f"(channels_last={self.channels_last})"
            ) from err
