"""Lean token batches: the shards' own ids cross to the GPU, which makes the other fields.

NOTE [lean batches]
    A default :class:`~shardloader.batching.blocks.TokenBlocks` batch is four int64
    ``[R, S]`` fields, 32 bytes a token, of which the loader builds three from the sidecars'
    lengths alone; building them and moving them to the device is most of a batch's cost.
    ``TokenBlocks(lean=True)`` hands over instead, per batch:

    * ``input_ids``: ``[R, S]`` in the shards' own dtype (``uint16`` or ``uint32``), each
      row's real tokens then 0 (not ``pad_id``: it may not fit the dtype);
    * ``row_tokens``: int32 ``[R]``, each row's real tokens (0 for a padding row);
    * ``cu_seqlens``, ``max_seqlen`` and ``__pad__`` exactly as the default batch has them;
    * ``pad_id`` and ``repeat_labels``: the planner's, so the expansion needs nothing else.

    :func:`expand_on_device` turns it into the default batch's fields on the device, equal
    value for value (``tests/test_lean_tokens.py`` checks every batch of an epoch), without a
    host synchronisation: positions restart at every ``cu_seqlens`` start, labels are the ids
    with -100 at every segment start, on padding and, under ``repeat_labels="ignore"``, on
    every flagged row (NOTE [flagged repeats] in :mod:`shardloader.batching.blockchunks`), and the
    attention mask is 1 on each row's first ``row_tokens`` tokens.  The plan is the same as
    without ``lean``: the same tokens go to the same rows, so it is no part of the plan
    signature and a run may switch it on resume.
"""

from __future__ import annotations

from typing import Any

import torch

from shardloader.batching.packed import IGNORE_INDEX

__all__ = ["expand_on_device"]


def expand_on_device(
    batch: dict[str, Any], device: torch.device | str | None = None, non_blocking: bool = False
) -> dict[str, Any]:
    """The default TokenBlocks batch made from a lean one on ``device`` (default: where its
    ``input_ids`` are): int64 ``input_ids``, ``labels``, ``position_ids`` and
    ``attention_mask`` ``[R, S]``, with ``cu_seqlens``, ``max_seqlen`` and ``__pad__``
    (NOTE [lean batches])."""
    if "row_tokens" not in batch:
        raise ValueError(
            "expand_on_device takes a lean TokenBlocks batch (TokenBlocks(..., lean=True)), "
            f"this one has {sorted(batch)}"
        )
    dev = torch.device(device) if device is not None else batch["input_ids"].device

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(dev, non_blocking=non_blocking)

    raw = move(batch["input_ids"])
    rows, seq = raw.shape
    ids = raw.to(torch.int64)
    real = torch.arange(seq, device=dev) < move(batch["row_tokens"]).to(torch.int64)[:, None]
    ids.masked_fill_(~real, int(batch["pad_id"]))
    cu = move(batch["cu_seqlens"])
    starts = cu[:-1].to(torch.int64)
    flat = torch.arange(rows * seq, device=dev)
    first = torch.repeat_interleave(starts, torch.diff(cu).to(torch.int64), output_size=rows * seq)
    positions = (flat - first).view(rows, seq)
    labels = ids.masked_fill(~real, IGNORE_INDEX)
    labels.view(-1).index_fill_(0, starts, IGNORE_INDEX)
    flagged = move(batch["__pad__"])
    if batch["repeat_labels"] == "ignore":
        labels.masked_fill_(flagged[:, None], IGNORE_INDEX)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "attention_mask": real.to(torch.int64),
        "cu_seqlens": cu,
        "max_seqlen": batch["max_seqlen"],
        "__pad__": flagged,
    }
