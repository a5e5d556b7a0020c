"""Batch planners and their collates, one module per policy.

* :mod:`~shardloader.batching.base`: the :class:`BatchPlanner` base class, :class:`PlanReport`,
  the accounting rule and plan signatures (NOTEs on what a batch is, how planner and collate
  agree, what a plan signature holds);
* :mod:`~shardloader.batching.default`: the default collate rules (:func:`collate_samples`);
* :mod:`~shardloader.batching.fixed`: :class:`FixedBatches` (and ``batch_size=``);
* :mod:`~shardloader.batching.padded`: :class:`BucketBatches`, :class:`TokenBudgetBatches`
  and :class:`PadCollate`;
* :mod:`~shardloader.batching.packed`: :class:`PackedBatches` (its collate :class:`PackCollate` in
  :mod:`~shardloader.batching.packcollate`) and
  :func:`pack_rows`;
* :mod:`~shardloader.batching.blocks`: :class:`TokenBlocks`, rows cut straight out of token
  shards' streams (it assembles its own batches: :mod:`~shardloader.batching.blockchunks`), and
  :func:`expand_on_device` for its lean batches (:mod:`~shardloader.batching.lean`);
* :mod:`~shardloader.batching.raw`: :class:`RawCollate`, its :class:`RawBatch` of
  :class:`ByteColumn` (raw bytes, one buffer per field).

This file only re-exports; DESIGN.md "How to add a planner" says where a new one goes.
"""

from shardloader.batching.base import (
    BatchPlanner,
    PlanReport,
    account,
    batch_ids,
    padded_length,
    signature_of,
)
from shardloader.batching.blocks import TokenBlocks
from shardloader.batching.default import collate_samples
from shardloader.batching.fit import Segment, pack_rows
from shardloader.batching.fixed import FixedBatches
from shardloader.batching.lean import expand_on_device
from shardloader.batching.packcollate import IGNORE_INDEX, PackCollate
from shardloader.batching.packed import PackedBatches
from shardloader.batching.padded import BucketBatches, PadCollate, TokenBudgetBatches
from shardloader.batching.raw import ByteColumn, RawBatch, RawCollate

__all__ = [
    "BatchPlanner",
    "PlanReport",
    "FixedBatches",
    "BucketBatches",
    "TokenBudgetBatches",
    "PackedBatches",
    "TokenBlocks",
    "PadCollate",
    "PackCollate",
    "RawCollate",
    "RawBatch",
    "ByteColumn",
    "IGNORE_INDEX",
    "account",
    "batch_ids",
    "collate_samples",
    "expand_on_device",
    "padded_length",
    "signature_of",
    "pack_rows",
    "Segment",
]
