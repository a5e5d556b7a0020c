"""Which rows of a token-block batch are no first delivery of their tokens, and what that does
to their labels.

NOTE [flagged repeats]
    Under ``uneven="pad"`` a rank whose partition has run out of batches repeats batches from
    the epoch's start, so every rank takes the same number of steps (DESIGN.md "Order and
    split", 4).  Those tokens were trained on once already.  Every token-block batch carries
    ``__pad__``, a bool ``[rows_per_batch]`` row flag (as sample batches carry one per
    sample): True for each row of a repeated batch and for each padding row a short last
    batch was filled up with.  A repeated row's ``labels`` are all -100
    (``TokenBlocks(repeat_labels="ignore")``, the default), so a loss with
    ``ignore_index=-100`` learns nothing from it twice; ``repeat_labels="keep"`` leaves them as
    the first delivery had them, flagged only.  Input ids, positions and the attention mask
    are unchanged: the step's shapes and its attention are what the first delivery had.
    Whether a step repeats is the plan's arithmetic (:meth:`~shardloader.plan.split.
    BatchSlots.repeats`), so every worker and rank flags the same rows, resumed or not.
"""

from __future__ import annotations

import numpy as np

from shardloader.batching.packed import IGNORE_INDEX

__all__ = ["REPEAT_LABELS", "flag_rows"]

REPEAT_LABELS = ("ignore", "keep")


def flag_rows(
    pad: np.ndarray,
    labels: np.ndarray | None,
    shard: np.ndarray,
    repeated: np.ndarray,
    mode: str,
) -> None:
    """Fill the ``[k, R]`` row flags of ``k`` assembled batches (``shard`` of each row, -1 for
    padding rows; ``repeated`` per batch) and, under ``mode="ignore"``, set a repeated batch's
    ``[k, R, S]`` labels to -100 (NOTE [flagged repeats]; a lean batch has no labels: the
    device makes them from the flags)."""
    k, rows = pad.shape
    np.less(shard.reshape(k, rows), 0, out=pad)
    if repeated.any():
        pad[repeated] = True
        if mode == "ignore" and labels is not None:
            labels[repeated] = IGNORE_INDEX
