"""What each source of a mixture delivers in an epoch, counted from the epoch's plans (the
per source part of ``Mixture.report``): pure, reads nothing but the recorded lengths given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["delivered_by_source"]


def delivered_by_source(
    plans: Sequence[Any], sizes: Sequence[int], lengths: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per source (virtual ids ``offset[s] + i``, ``sizes`` per source): documents and tokens
    every partition's ``plans`` deliver, each position once (a last batch's filling-up and
    dropped batches not counted), and whether the batches were segments ``(id, start, stop)``
    (then tokens are counted from them, lengths or not)."""
    kept, real = [], []
    for plan in plans:
        mine = plan.kept()
        kept += mine
        if mine and mine[0].ndim == 1:
            ids = np.concatenate(mine).astype(np.int64)
            if plan.pad_in_last and len(mine) == plan.num_batches:
                ids = ids[: len(ids) - plan.pad_in_last]
            real.append(ids)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    k = len(sizes)
    tokens = np.zeros(k, np.int64)
    flat = bool(kept) and kept[0].ndim == 2
    if flat:  # segments (id, start, stop): a document starts at 0
        seg = np.concatenate(kept)
        seg_src = np.searchsorted(offsets, seg[:, 0], side="right") - 1
        samples = np.bincount(seg_src[seg[:, 1] == 0], minlength=k)
        tokens += np.bincount(seg_src, seg[:, 2] - seg[:, 1], k).astype(np.int64)
    else:
        ids = np.concatenate(real or [np.zeros(0, np.int64)])
        src = np.searchsorted(offsets, ids, side="right") - 1
        samples = np.bincount(src, minlength=k)
        if lengths is not None:
            tokens += np.bincount(src, lengths[ids], k).astype(np.int64)
    return samples, tokens, flat
