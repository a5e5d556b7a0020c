"""Collate for detection-style samples: a variable number of items (boxes, labels) each.

Built on the default collate rules (:mod:`shardloader.batching.default`) and
:class:`~shardloader.batching.padded.PadCollate`'s padding; images of different sizes stay a
list, so it pairs with any transform of :mod:`shardloader.vision` or none.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardloader.batching.default import as_array, collate_samples, to_tensor
from shardloader.batching.padded import PadCollate
from shardloader.errors import UsageError

__all__ = ["DetectionCollate"]

DETECTION_MODES = ("concat", "pad")


@dataclass(frozen=True)
class DetectionCollate:
    """Collate for samples with a variable number of items (boxes, their labels, masks).

    ``item_fields`` hold one row per item (e.g. ``boxes`` [N, 4], ``labels`` [N]); every item
    field of a sample must have the same N.  ``mode="concat"`` (default) concatenates them to
    [sum N, ...] and adds ``batch_index`` (int64 [sum N], the sample each item belongs to);
    ``mode="pad"`` pads them to [B, max N, ...] with the explicit ``pad_values`` and adds
    ``num_items`` (int64 [B]).  Other fields follow the default rules, except that arrays of
    unequal shapes (images of different sizes) stay a list instead of raising.
    """

    item_fields: Collection[str] = ("boxes", "labels")
    mode: str = "concat"
    pad_values: Mapping[str, int | float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        fields = self.item_fields
        if (
            isinstance(fields, str)
            or not isinstance(fields, Collection)
            or not all(isinstance(f, str) for f in fields)
        ):
            raise UsageError(
                f"item_fields must be field names, e.g. ('boxes', 'labels'), got {fields!r}"
            )
        object.__setattr__(self, "item_fields", tuple(fields))
        object.__setattr__(self, "pad_values", dict(self.pad_values))
        if self.mode not in DETECTION_MODES:
            raise UsageError(f"mode={self.mode!r} is not one of {DETECTION_MODES}")
        if self.mode == "pad":
            missing = [f for f in self.item_fields if f not in self.pad_values]
            if missing:
                raise UsageError(
                    f"DetectionCollate(mode='pad') needs a pad value for {', '.join(missing)}: "
                    "pass pad_values={...} (e.g. 0.0 for boxes, -1 for labels), or use "
                    "mode='concat'"
                )

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise UsageError("cannot collate an empty batch")
        present = [f for f in self.item_fields if f in samples[0]]
        rest = [{k: v for k, v in s.items() if k not in present} for s in samples]
        out = collate_samples(rest, ragged="list") if rest[0] else {}
        counts: list[int] = []
        for i, s in enumerate(samples):
            ns = {f: len(s[f]) for f in present}
            if len(set(ns.values())) > 1:
                raise UsageError(
                    f"sample {i} has different item counts per field ({ns}); every item field "
                    "needs one row per item"
                )
            counts.append(next(iter(ns.values()), 0))
        concat = self.mode == "concat"
        extra = "batch_index" if concat else "num_items"
        if extra in out:
            raise UsageError(f"samples already have a field {extra!r}; rename it")
        for name in present:
            arrays = [to_tensor(as_array(name, s[name])) for s in samples]
            if concat:
                out[name] = torch.cat(arrays)
            else:
                out[name] = PadCollate({name: self.pad_values[name]}).pad(name, arrays)[0]
        if present:
            n = torch.tensor(counts, dtype=torch.int64)
            out[extra] = torch.repeat_interleave(torch.arange(len(samples)), n) if concat else n
        return out
