"""Fixed-count batches: the default plan (``batch_size=``), and :class:`FixedBatches`.

Fixed batches know nothing about lengths: whatever padding or truncation they cost is the
collate's (a :class:`~shardloader.batching.padded.PadCollate`), so their accounting asks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.batching.base import BatchPlanner, PlanReport, account, as_ids, check_positive
from shardloader.batching.padded import PadCollate

__all__ = ["FixedBatches", "account_fixed"]


@dataclass(frozen=True)
class FixedBatches(BatchPlanner):
    """Consecutive ``batch_size`` ids of the order; ``drop_last`` drops the short last batch.

    Its :meth:`report` counts no padding: that is the collate's here, and the dataset counts
    it with :func:`account_fixed`, which knows the collate."""

    batch_size: int
    drop_last: bool = False
    elastic = "batch_size"  # what a resume may change (shardloader/plan/elastic.py)

    def __post_init__(self) -> None:
        check_positive("batch_size", self.batch_size)

    def plan(
        self, order: np.ndarray, lengths: np.ndarray | None, rng: np.random.Generator
    ) -> list[np.ndarray]:
        ids = as_ids(order)
        n = ids.size - ids.size % self.batch_size if self.drop_last else ids.size
        return [ids[s : s + self.batch_size] for s in range(0, n, self.batch_size)]

    def explain_dropped(self, tokens: int | None) -> str:
        """Why the plan left a sample out (for the ledger): only ``drop_last`` does."""
        return f"drop_last=True: in the epoch's short last batch (batch_size={self.batch_size})"


def account_fixed(
    order: np.ndarray,
    lengths: np.ndarray | None,
    batches: Sequence[np.ndarray],
    collate_fn: Any,
) -> PlanReport:
    """:func:`~shardloader.batching.base.account` for fixed batches (``batch_size=`` or
    :class:`FixedBatches`): a PadCollate's ``max_length`` and ``pad_to_multiple_of`` decide what
    is truncated and how many token slots each batch costs; any other collate pads nothing we
    can count."""
    pad = collate_fn if isinstance(collate_fn, PadCollate) else PadCollate()  # pads nothing
    m = pad.pad_to_multiple_of
    return account(order, lengths, batches, max_length=pad.max_length, pad_to_multiple_of=m)
