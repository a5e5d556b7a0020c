"""What each source of a mixture delivers in an epoch, counted from the epoch's plans (the
per source part of ``Mixture.report``): pure, reads nothing but the recorded lengths given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["delivered_by_source", "source_counts"]


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
    flat = bool(kept) and kept[0].ndim == 2
    if flat:  # segments (id, start, stop): a document starts at 0
        seg = np.concatenate(kept)
        samples, _ = source_counts(seg[seg[:, 1] == 0, 0], sizes)
        _, tokens = source_counts(seg[:, 0], sizes, seg[:, 2] - seg[:, 1])
    else:
        ids = np.concatenate(real or [np.zeros(0, np.int64)])
        samples, tokens = source_counts(ids, sizes, None if lengths is None else lengths[ids])
    if tokens is None:
        tokens = np.zeros(len(sizes))
    return samples, tokens.astype(np.int64), flat


def source_counts(
    ids: np.ndarray, sizes: Sequence[int], weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Per source (``sizes`` samples each, virtual ids ``offset[s] + i``): how many of ``ids``
    are its, and the sum of their ``weights`` (None without)."""
    src = np.searchsorted(np.cumsum(sizes), ids, side="right")
    k = len(sizes)
    return np.bincount(src, minlength=k), None if weights is None else np.bincount(src, weights, k)
