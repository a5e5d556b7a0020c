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
batch's int32 ``cu_seqlens``, one after the other, then the ``[k, R]`` bool ``__pad__`` row
flags (NOTE [flagged repeats] in ``shardloader/batching/blockchunks.py``).  A lean buffer
(``TokenBlocks(lean=True)``, :mod:`shardloader.batching.lean`) holds ``[k, R, S]`` ids in the
shard's own dtype instead of the block (its size rounded up to 8 bytes), then the
``cu_seqlens``, then the int32 ``[k, R]`` real tokens per row, then the row flags.

NOTE [bundles]
    A bundle of ``k`` batches crosses as one item.  Only
    :class:`~shardloader.deliver.loader.ShardLoader` unpacks bundles (it yields their batches one
    by one and counts each as a step), so only it asks for them: its ``worker_init_fn``
    (:class:`~shardloader.deliver.workers.WorkerInit`) sets the bundle size on the worker's copy
    of the dataset.  A worker then serves whole bundles of the rank's steps (bundle ``c`` holds
    steps ``c*k .. c*k+k-1`` and goes to worker ``c mod K``); torch's DataLoader returns worker
    outputs round-robin, so the rank's batches still arrive in step order, the same whatever ``K``
    or ``k``.  Any other consumer (a plain DataLoader) gets one batch per item.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.heap
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from shardloader.errors import ShardError

__all__ = [
    "BUNDLE_BYTES",
    "Bundle",
    "Ring",
    "TokenBatches",
    "unbundle",
    "worker_bundle",
]

BUNDLE_BYTES = 4 << 20  # about this much per worker output (NOTE [bundles])
MAX_BUNDLE = 64  # batches
_FIELDS = ("input_ids", "labels", "position_ids", "attention_mask")
_TORCH = {"uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32}
_TORCH.update({"int32": torch.int32, "int64": torch.int64})


class Bundle(list):  # type: ignore[type-arg]
    """Consecutive batches of one rank that crossed from a worker as one item (NOTE
    [bundles]); :class:`~shardloader.deliver.loader.ShardLoader` yields them one by one."""


def unbundle(item: Any) -> Sequence[Any]:
    """The batches an item of the DataLoader holds: a bundle's, or the item itself."""
    return item if isinstance(item, Bundle) else (item,)


class TokenBatches:
    """``k`` token batches in one buffer: ``block`` (numpy int64 ``[4, k, R, S]``) and ``cu``
    (numpy int32, the batches' ``cu_seqlens`` one after the other) to fill, with ``cu_sizes``
    and ``max_seqlen``; then :meth:`batches` (this process) or pickling (to the main process)
    gives the dicts.  A lean buffer (``lean``: the ids' dtype, the pad id and the
    ``repeat_labels`` mode) has ``ids`` (``[k, R, S]``) and ``row_tokens`` in place of
    ``block``.

    The buffer comes from this process's pool (no ``worker``), else from a free slot of the
    worker's :class:`Ring`, else from fresh shared memory.
    """

    def __init__(
        self,
        k: int,
        rows: int,
        seq_len: int,
        cu_total: int,
        worker: int | None = None,
        ring: Ring | None = None,
        lean: tuple[str, int, str] | None = None,
    ) -> None:
        self.shape = (1 if lean else len(_FIELDS), k, rows, seq_len)
        self.lean = lean
        self.cu_sizes: tuple[int, ...] = ()  # the length of each batch's cu_seqlens
        self.max_seqlen: tuple[int, ...] = ()
        self.bundle = False
        head = _head_bytes(self.shape, lean)
        tail = k * rows * 4 if lean else 0  # a lean buffer's real tokens per row
        self.nbytes = nbytes = head + cu_total * 4 + tail + k * rows  # + the __pad__ row flags
        self.slot: tuple[Ring, int, int] | None = None
        self.buffer: torch.Tensor | None = None
        taken = ring.take(worker, nbytes) if ring is not None and worker is not None else None
        if taken is not None:  # a slot both processes map already: nothing to hand over
            self.slot = (ring, worker, taken[0])  # type: ignore[assignment]
            raw = taken[1]
        elif worker is not None:  # created in shared memory: handing it over copies nothing
            storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
            self.buffer = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
            raw = self.buffer.numpy()
        else:
            raw = _POOL.take(nbytes)
            self.buffer = torch.from_numpy(raw)
        words = k * rows * seq_len
        if lean:
            self.ids = raw[: words * np.dtype(lean[0]).itemsize].view(lean[0])
            self.ids = self.ids.reshape(k, rows, seq_len)
        else:
            self.block = raw[:head].view(np.int64).reshape(self.shape)
        at = head + cu_total * 4
        self.cu = raw[head:at].view(np.int32)
        self.row_tokens = raw[at : at + tail].view(np.int32).reshape(k, -1)
        self.pad = raw[at + tail :].view(np.bool_).reshape(k, rows)

    def __reduce__(self) -> tuple[Any, ...]:
        state = (self.shape, self.cu_sizes, self.max_seqlen, self.bundle, self.lean)
        if self.slot is not None:
            ring, worker, slot = self.slot
            return _from_ring, (ring.id, worker, slot, self.nbytes, state)
        return _rebuild, (self.buffer, state)

    def batches(self) -> list[dict[str, Any]]:
        """The batch dicts, as views into the buffer (in this process)."""
        assert self.buffer is not None
        return _build(self.buffer, self.shape, self.cu_sizes, self.max_seqlen, self.lean)


def _head_bytes(shape: tuple[int, int, int, int], lean: tuple[str, int, str] | None) -> int:
    """Bytes before the ``cu_seqlens``: the int64 block, or a lean buffer's ids (rounded up
    to 8 bytes, so what follows stays aligned)."""
    words = shape[0] * shape[1] * shape[2] * shape[3]
    if not lean:
        return words * 8
    return -(-words * np.dtype(lean[0]).itemsize // 8) * 8


_FREE, _SENT, _HELD = 0, 1, 2


class Ring:
    """Shared buffers a :class:`~shardloader.deliver.loader.ShardLoader` and its workers map once,
    reused batch after batch: ``slots`` per worker of ``slot_bytes`` each.

    NOTE [ring slots]
        One byte per slot says who may touch it.  A worker takes a ``FREE`` slot, marks it
        ``SENT``, writes a bundle into it and yields a :class:`TokenBatches` that pickles to
        (ring id, worker, slot, layout): no tensor, no file descriptor crosses.  Unpickling in
        the main process marks the slot ``HELD`` and builds the batches as tensors over a
        fresh numpy view of it, which lives exactly as long as any of those tensors does
        (``torch.from_numpy`` keeps the array it was given alive); the ring keeps only a weak
        reference to that view.  Each later arrival hands every ``HELD`` slot whose view is
        gone back as ``FREE``; a ``SENT`` slot (its bundle still on the way) is never touched.
        A worker that finds no free slot (the loop keeps old batches) uses fresh shared memory
        instead, so nothing waits and nothing is overwritten while a batch can still be read.

    The memory is a ``multiprocessing.heap.Arena`` (what a RawArray lives in): forked workers
    inherit its mapping, and spawned ones get its file descriptor when they start.
    """

    def __init__(self, workers: int, slots: int, slot_bytes: int) -> None:
        self.id = uuid.uuid4().hex
        self.workers, self.slots, self.slot_bytes = workers, slots, slot_bytes
        head = -(-workers * slots // 64) * 64
        # an unlinked file in /dev/shm, zero until written (a RawArray would write every page)
        self.array: Any = multiprocessing.heap.Arena(head + workers * slots * slot_bytes)
        self.received = 0  # bundles that arrived through a slot (in the main process)
        self._attach()
        _RINGS[self.id] = self

    def _attach(self) -> None:
        n = self.workers * self.slots
        head = -(-n // 64) * 64
        raw = np.frombuffer(self.array.buffer, np.uint8)
        self.states: np.ndarray | None = raw[:n].reshape(self.workers, self.slots)
        size = self.slot_bytes
        self.bufs = [raw[head + i * size : head + (i + 1) * size] for i in range(n)]
        self.views: list[Any] = [None] * n  # weak references to the views handed out

    def __getstate__(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in ("id", "workers", "slots", "slot_bytes")}
        if multiprocessing.context.get_spawning_popen() is not None:
            state["array"] = self.array  # a spawned worker maps the same memory
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.states, self.bufs, self.views = None, [], []
        if state.get("array") is not None:
            self._attach()

    # -- in the worker ----------------------------------------------------------------------
    def take(self, worker: int, nbytes: int) -> tuple[int, np.ndarray] | None:
        """A free slot of ``worker`` that holds ``nbytes`` (marked ``SENT``), or None."""
        if self.states is None or nbytes > self.slot_bytes or not 0 <= worker < self.workers:
            return None
        free = np.flatnonzero(self.states[worker] == _FREE)
        if not free.size:
            return None
        slot = int(free[0])
        self.states[worker, slot] = _SENT
        return slot, self.bufs[worker * self.slots + slot][:nbytes]

    # -- in the main process ----------------------------------------------------------------
    def receive(self, worker: int, slot: int, nbytes: int) -> torch.Tensor:
        """The bytes of a bundle that arrived: marks its slot ``HELD``, frees older ones; the
        ring keeps only a weak reference to the view the batch tensors are built over."""
        self.collect()
        assert self.states is not None
        i = worker * self.slots + slot
        view = self.bufs[i][:nbytes]
        self.views[i] = weakref.ref(view)
        self.states[worker, slot] = _HELD
        self.received += 1
        return torch.from_numpy(view)

    def collect(self) -> None:
        """Hand back every slot received here (``HELD``) whose view nothing refers to any more."""
        if self.states is None:
            return
        states = self.states.reshape(-1)
        for i in np.flatnonzero(states == _HELD).tolist():
            ref = self.views[i]
            if ref is None or ref() is None:
                self.views[i] = None
                states[i] = _FREE


_RINGS: weakref.WeakValueDictionary[str, Ring] = weakref.WeakValueDictionary()


def slot_view(ring_id: str, worker: int, slot: int, nbytes: int) -> torch.Tensor:
    """The bytes of a batch a worker wrote into slot ``slot`` of ring ``ring_id``, in the main
    process (:meth:`Ring.receive`)."""
    ring = _RINGS.get(ring_id)
    if ring is None or ring.states is None:
        raise ShardError(
            "a batch arrived for a DataLoader whose shared buffers are gone (the "
            "ShardLoader that started the worker no longer exists in this process)"
        )
    return ring.receive(worker, slot, nbytes)


def _from_ring(ring_id: str, worker: int, slot: int, nbytes: int, state: tuple[Any, ...]) -> Any:
    """Unpickling a :class:`TokenBatches` written into a ring slot, in the main process."""
    return _rebuild(slot_view(ring_id, worker, slot, nbytes), state)


class _Pool:
    """Buffers for batches assembled in this process, reused once no batch views them.

    A fresh multi-megabyte buffer costs a page fault per 4 KiB on first write, more than the
    assembly itself.  Each use hands out a fresh numpy view of a buffer, which the batches'
    tensors keep alive (``torch.from_numpy`` holds the array it was given); the pool keeps a
    weak reference to it, so the buffer is free again exactly when the last batch is gone.
    At most :data:`_KEEP` buffers are kept.
    """

    def __init__(self) -> None:
        self.buffers: list[tuple[np.ndarray, Any]] = []  # (buffer, weak ref to its view)
        self.reused = 0

    def take(self, nbytes: int) -> np.ndarray:
        for i, (buf, ref) in enumerate(self.buffers):
            if buf.nbytes >= nbytes and ref() is None:
                view = buf[:nbytes]
                self.buffers[i] = (buf, weakref.ref(view))
                self.reused += 1
                return view
        size = (nbytes // _ROUND + 1) * _ROUND  # room for the next chunk's cu_seqlens too
        buf = np.empty(size, np.uint8)
        view = buf[:nbytes]
        self.buffers = [*self.buffers, (buf, weakref.ref(view))][-_KEEP:]
        return view


_ROUND = 256 << 10
_KEEP = 3  # the chunk being read, its last batch, slack
_POOL = _Pool()


def _build(
    buffer: torch.Tensor,
    shape: tuple[int, int, int, int],
    cu_sizes: tuple[int, ...],
    max_seqlen: tuple[int, ...],
    lean: tuple[str, int, str] | None = None,
) -> list[dict[str, Any]]:
    head = _head_bytes(shape, lean)
    k, rows = shape[1], shape[2]
    end = head + sum(cu_sizes) * 4
    cu = buffer[head:end].view(torch.int32)
    if lean:  # NOTE [lean batches] in shardloader/batching/lean.py
        dtype, pad_id, repeat_labels = lean
        words = k * rows * shape[3]
        ids = buffer[:head].view(_TORCH[dtype])[:words].view(k, rows, shape[3])
        row_tokens = buffer[end : end + k * rows * 4].view(torch.int32).view(k, rows)
        end += k * rows * 4
        fields = [
            {"input_ids": i, "row_tokens": n, "pad_id": pad_id, "repeat_labels": repeat_labels}
            for i, n in zip(ids.unbind(0), row_tokens.unbind(0), strict=True)
        ]
    else:
        block = buffer[:head].view(torch.int64).view(shape)
        fields = [dict(zip(_FIELDS, f.unbind(0), strict=True)) for f in block.unbind(1)]
    pads = buffer[end : end + k * rows].view(torch.bool).view(k, rows).unbind(0)
    # one split and one unbind give every batch's views (a slice or index a batch costs more)
    cus = cu.split(cu_sizes)
    for batch, c, longest, pad in zip(fields, cus, max_seqlen, pads, strict=True):
        batch["cu_seqlens"] = c
        batch["max_seqlen"] = longest
        batch["__pad__"] = pad
    return fields


def _rebuild(buffer: torch.Tensor, state: tuple[Any, ...]) -> Any:
    """Unpickling :class:`TokenBatches` in the main process: the batch, or a :class:`Bundle`
    of them."""
    shape, cu_sizes, max_seqlen, bundle, lean = state
    out = _build(buffer, shape, cu_sizes, max_seqlen, lean)
    return Bundle(out) if bundle else out[0]


def batch_bytes(dataset: Any) -> int:
    """Bytes of each of ``dataset``'s batches when its planner's all have one size, else 0."""
    return 0 if dataset.planner is None else int(dataset.planner.batch_bytes or 0)


def worker_bundle(dataset: Any) -> int:
    """Batches per worker output for a :class:`~shardloader.deliver.loader.ShardLoader` over
    ``dataset``: 1, or for a planner whose batches have a fixed size (``batch_bytes``), as
    many as fill :data:`BUNDLE_BYTES`."""
    size = batch_bytes(dataset)
    if not size:  # raw batches: bundled by their mean size (NOTE [raw bundles])
        return int(dataset.raw_bundle())
    return min(max(1, BUNDLE_BYTES // int(size)), MAX_BUNDLE)
