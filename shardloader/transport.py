"""Token batches handed from DataLoader workers as one shared buffer, not one per field.

torch's DataLoader moves every tensor of a worker's output through a shared-memory segment of
its own: the worker creates and maps it, passes its file descriptor over a socket, and the main
process maps it again and unmaps it when the batch is freed.  Per tensor that costs about what
assembling a whole 8 x 2048-token batch does, so a batch of five tensors spent most of its time
in transit.  Here a worker writes every field of a batch, or of a *bundle* of consecutive
batches, into one buffer allocated in shared memory and sends that buffer with a few numbers;
unpickling in the main process rebuilds the batch dicts as views into it (:func:`_rebuild`).
Without workers the same layout lives in ordinary memory.

Layout of a buffer holding ``k`` batches of ``R`` x ``S`` tokens: the four int64 fields as one
``[4, k, R, S]`` block (:data:`~shardloader.batching.blocks.FIELDS` in order), then every
batch's int32 ``cu_seqlens``, one after the other.

NOTE [bundles]
    A bundle of ``k`` batches crosses as one item.  Only :class:`~shardloader.loader.ShardLoader`
    unpacks bundles (it yields their batches one by one and counts each as a step), so only it
    asks for them: its ``worker_init_fn`` (:class:`BundleInit`) sets the bundle size on the
    worker's copy of the dataset.  A worker then serves whole bundles of the rank's steps
    (bundle ``c`` holds steps ``c*k .. c*k+k-1`` and goes to worker ``c mod K``); torch's
    DataLoader returns worker outputs round-robin, so the rank's batches still arrive in step
    order, the same whatever ``K`` or ``k``.  Any other consumer (a plain DataLoader) gets one
    batch per item.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "BUNDLE_BYTES",
    "Bundle",
    "BundleInit",
    "TokenBatches",
    "unbundle",
    "worker_bundle",
]

BUNDLE_BYTES = 4 << 20  # about this much per worker output (NOTE [bundles])
_FIELDS = ("input_ids", "labels", "position_ids", "attention_mask")


class Bundle(list):  # type: ignore[type-arg]
    """Consecutive batches of one rank that crossed from a worker as one item (NOTE
    [bundles]); :class:`~shardloader.loader.ShardLoader` yields them one by one."""


def unbundle(item: Any) -> Sequence[Any]:
    """The batches an item of the DataLoader holds: a bundle's, or the item itself."""
    return item if isinstance(item, Bundle) else (item,)


class TokenBatches:
    """``k`` token batches in one buffer: ``block`` (numpy int64 ``[4, k, R, S]``) and ``cu``
    (numpy int32, the batches' ``cu_seqlens`` one after the other) to fill, with ``cu_sizes``
    and ``max_seqlen``; then :meth:`batches` (this process) or pickling (to the main process)
    gives the dicts."""

    def __init__(self, k: int, rows: int, seq_len: int, cu_total: int, shared: bool):
        self.shape = (len(_FIELDS), k, rows, seq_len)
        self.cu_sizes: tuple[int, ...] = ()  # the length of each batch's cu_seqlens
        words = len(_FIELDS) * k * rows * seq_len
        nbytes = words * 8 + cu_total * 4
        if shared:  # created in shared memory: handing it to another process copies nothing
            storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
            self.buffer = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
            raw = self.buffer.numpy()
        else:
            raw = _POOL.take(nbytes)
            self.buffer = torch.from_numpy(raw)
        self.block = raw[: words * 8].view(np.int64).reshape(self.shape)
        self.cu = raw[words * 8 :].view(np.int32)
        self.max_seqlen: tuple[int, ...] = ()
        self.bundle = False

    def __reduce__(self) -> tuple[Any, ...]:
        state = (self.shape, self.cu_sizes, self.max_seqlen, self.bundle)
        return _rebuild, (self.buffer, state)

    def batches(self) -> list[dict[str, Any]]:
        """The batch dicts, as views into the buffer."""
        return _build(self.buffer, self.shape, self.cu_sizes, self.max_seqlen)


class _Pool:
    """Buffers for batches assembled in this process, reused once no batch views them.

    A fresh multi-megabyte buffer costs a page fault per 4 KiB on first write, more than the
    assembly itself.  A buffer is free again when only the pool refers to it: every tensor of
    its batches holds a reference (torch.from_numpy keeps the array alive), so CPython's
    reference count says exactly when the last batch is gone.  At most ``keep`` buffers wait.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.free: list[np.ndarray] = []  # the newest buffers, free or in use

    def take(self, nbytes: int) -> np.ndarray:
        for buf in self.free:
            # 3 references: the list, the loop variable and getrefcount's argument
            if buf.nbytes >= nbytes and sys.getrefcount(buf) <= 3:
                return buf[:nbytes]
        buf = np.empty(max(nbytes, 1), np.uint8)
        self.free = [*self.free, buf][-self.keep :]
        return buf[:nbytes]


_POOL = _Pool()


def _build(
    buffer: torch.Tensor,
    shape: tuple[int, int, int, int],
    cu_sizes: tuple[int, ...],
    max_seqlen: tuple[int, ...],
) -> list[dict[str, Any]]:
    words = shape[0] * shape[1] * shape[2] * shape[3]
    block = buffer[: words * 8].view(torch.int64).view(shape)
    cu = buffer[words * 8 :].view(torch.int32)
    out = []
    at = 0
    for fields, size, longest in zip(block.unbind(1), cu_sizes, max_seqlen, strict=True):
        batch = dict(zip(_FIELDS, fields.unbind(0), strict=True))
        batch["cu_seqlens"] = cu[at : at + size]
        batch["max_seqlen"] = longest
        out.append(batch)
        at += size
    return out


def _rebuild(buffer: torch.Tensor, state: tuple[Any, ...]) -> Any:
    """Unpickling :class:`TokenBatches` in the main process: the batch, or a :class:`Bundle`
    of them."""
    shape, cu_sizes, max_seqlen, bundle = state
    out = _build(buffer, shape, cu_sizes, max_seqlen)
    return Bundle(out) if bundle else out[0]


def worker_bundle(dataset: Any) -> int:
    """Batches per worker output for a :class:`~shardloader.loader.ShardLoader` over
    ``dataset``: 1, or for a planner whose batches have a fixed size (``batch_bytes``), as
    many as fill :data:`BUNDLE_BYTES`."""
    size = getattr(getattr(dataset, "planner", None), "batch_bytes", None)
    if not size:
        return 1
    return max(1, BUNDLE_BYTES // int(size))


class BundleInit:
    """The ``worker_init_fn`` of a ShardLoader whose workers send bundles: sets the bundle
    size on the worker's copy of the dataset, then calls the user's function (if any)."""

    def __init__(self, bundle: int, user: Any = None) -> None:
        self.bundle, self.user = bundle, user

    def __call__(self, worker_id: int) -> None:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is not None:
            info.dataset._bundle = self.bundle
        if self.user is not None:
            self.user(worker_id)
