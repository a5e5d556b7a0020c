"""Batches handed over through shared memory when ``shardloader serve`` and its client share a host.

Over loopback TCP every payload byte is copied four times (into the HTTP layer's chunk, into
the kernel, out of it, into the client's buffer) and crosses the event loop in 256 KiB pieces.
Here the server copies a frame's payload once, into a slot of a segment both processes map,
and the TCP stream carries only the frame's header (``"shm": [slot, nbytes]``).

NOTE [shm handover]
    1. A client that asks (``/v1/batches?...&shm=1``) gets, before the first batch, a ``shm``
       control frame naming a segment the server created in its shared-memory folder
       (``/dev/shm``): ``name``, ``size``, ``slots``, ``slot_bytes`` and a random ``nonce``.
    2. The client opens that name in *its* shared-memory folder (mode 0600: same user only),
       checks the magic, size and nonce, maps it and sets the ``attached`` byte.  A client on
       another host (or in another container, or another user) cannot, and stays on TCP; so
       does one whose name resolves to some other file, since only the segment the server
       created holds its nonce.
    3. The server sends a frame through a slot only once it sees ``attached``; at that moment
       it unlinks the name (both processes hold their mapping, so nothing is left in
       ``/dev/shm`` from then on, whatever happens to either process).  A stream that ends
       before the client attached unlinks the name when it closes.
    4. One byte per slot says who may touch it (the worker transport's NOTE [ring slots]):
       the server takes a ``FREE`` slot, marks it ``SENT``, copies the payload and sends the
       header; the client marks it ``HELD`` on arrival and decodes the batch as tensors over a
       fresh view of the slot, which lives exactly as long as any of them does; each later
       arrival (and each batch the loop takes) hands every ``HELD`` slot whose view is gone
       back as ``FREE``.  A server that finds no ``FREE`` slot for :data:`WAIT_SECONDS` (the
       loop keeps old batches) sends that frame over TCP instead: nothing is overwritten while
       a batch can still be read, and nothing waits forever.
    Only numbers and raw tensor bytes cross; nothing is unpickled.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
import time
from typing import Any

import numpy as np

from shardloader.deliver.slots import lend, take_back
from shardloader.errors import DecodeError
from shardloader.service.shmfiles import (
    NAME,
    create_server_file,
    leftover_segments,
    map_server_file,
)

__all__ = [
    "Attachment",
    "Segment",
    "SHM_DIR",
    "WAIT_SECONDS",
    "leftover_segments",
    "segment_size",
]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
WAIT_SECONDS = 0.05  # a full ring waits this long for a slot, then the frame goes over TCP
_MAGIC = b"SLSHM001"
_ATTACHED = 24  # byte offset of the flag the client sets
_STATES = 64
_PAGE = 4096
_FREE, _SENT, _HELD = 0, 1, 2
MAX_SLOTS = 256


def _layout(slots: int, slot_bytes: int) -> tuple[int, int]:
    """(offset of slot 0, total size) of a segment."""
    data = -(-(_STATES + slots) // _PAGE) * _PAGE
    return data, data + slots * slot_bytes


def segment_size(slots: int, slot_bytes: int) -> int:
    """The bytes a :class:`Segment` of ``slots`` x ``slot_bytes`` takes."""
    return _layout(slots, -(-slot_bytes // _PAGE) * _PAGE)[1]


class Segment:
    """The server's side of one stream's segment (NOTE [shm handover])."""

    def __init__(self, folder: str, slots: int, slot_bytes: int) -> None:
        slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        self.slots, self.slot_bytes = slots, slot_bytes
        self.data, self.size = _layout(slots, slot_bytes)
        self.file, mm = create_server_file(folder, self.size)
        self.name = self.file.name
        self._mm: mmap.mmap | None = mm
        self.nonce = secrets.token_hex(16)
        self.buf = np.frombuffer(self._mm, np.uint8)
        self.buf[: len(_MAGIC)] = np.frombuffer(_MAGIC, np.uint8)
        self.buf[8:24] = np.frombuffer(bytes.fromhex(self.nonce), np.uint8)
        self.states = self.buf[_STATES : _STATES + slots]
        self._attached = False
        self.mine = (0, slots)  # the slots this process's place() uses (workers take others)
        self.used = 0  # frames sent through a slot
        self.fallbacks = 0  # frames that found no free slot and went over TCP

    def announce(self) -> dict[str, Any]:
        """The ``shm`` control frame's fields."""
        return {
            "name": self.name,
            "size": self.size,
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "nonce": self.nonce,
        }

    @property
    def attached(self) -> bool:
        if not self._attached and self.buf[_ATTACHED] == 1:
            self._attached = True
            self._unlink()  # both sides map it now: the name is no longer needed
        return self._attached

    def wait_attached(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the client to map the segment (it does on reading the
        announcement; a client that cannot stays on TCP)."""
        deadline = time.monotonic() + seconds
        while not self.attached and time.monotonic() < deadline:
            time.sleep(0.0005)
        return self._attached

    def place(self, nbytes: int) -> tuple[int, np.ndarray] | None:
        """A slot for ``nbytes`` (marked ``SENT``), or None: send this frame over TCP."""
        if nbytes > self.slot_bytes or not self.attached:
            return None
        deadline = 0.0
        lo, hi = self.mine
        while True:
            free = np.flatnonzero(self.states[lo:hi] == _FREE) + lo
            if free.size:
                break
            now = time.monotonic()
            if not deadline:
                deadline = now + WAIT_SECONDS
            elif now >= deadline:
                self.fallbacks += 1
                return None
            time.sleep(0.0002)
        slot = int(free[0])
        self.states[slot] = _SENT
        self.used += 1
        start = self.data + slot * self.slot_bytes
        return slot, self.buf[start : start + nbytes]

    def take(self, lo: int, hi: int, nbytes: int) -> tuple[int, np.ndarray] | None:
        """A free slot among ``lo..hi`` (a DataLoader worker's own), without waiting."""
        if nbytes > self.slot_bytes:
            return None
        free = np.flatnonzero(self.states[lo:hi] == _FREE)
        if not free.size:
            return None
        slot = lo + int(free[0])
        self.states[slot] = _SENT
        start = self.data + slot * self.slot_bytes
        return slot, self.buf[start : start + nbytes]

    def _unlink(self) -> None:
        self.file.unlink()

    def close(self) -> None:
        """Unlink the name (if the client never attached) and drop this side's mapping."""
        self._unlink()
        self.states = self.buf = np.empty(0, np.uint8)
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere: the GC unmaps it later
                pass


class Attachment:
    """The client's side of a stream's segment: slots decoded as batches, and freed again."""

    def __init__(self, folder: str, announce: dict[str, Any]) -> None:
        try:
            name, size = str(announce["name"]), int(announce["size"])
            slots, slot_bytes = int(announce["slots"]), int(announce["slot_bytes"])
            nonce = bytes.fromhex(str(announce["nonce"]))
        except (KeyError, TypeError, ValueError) as err:
            raise DecodeError(f"malformed shm announcement {str(announce)[:200]}") from err
        if (
            not NAME.match(name)
            or not 0 < slots <= MAX_SLOTS
            or slot_bytes <= 0
            or slot_bytes % _PAGE
            or _layout(slots, slot_bytes)[1] != size
            or len(nonce) != 16
        ):
            raise DecodeError(f"malformed shm announcement {str(announce)[:200]}")
        path = os.path.join(folder, name)
        mm = map_server_file(path, size, "segment")  # OSError: not on this host
        buf = np.frombuffer(mm, np.uint8)
        if buf[:8].tobytes() != _MAGIC or buf[8:24].tobytes() != nonce:
            raise FileNotFoundError(f"{path} is not the server's segment")
        self.name, self.slots, self.slot_bytes = name, slots, slot_bytes
        self.data = _layout(slots, slot_bytes)[0]
        self.buf = buf
        self.states = buf[_STATES : _STATES + slots]
        self.views: list[Any] = [None] * slots
        self.received = 0
        self._lock = threading.Lock()
        buf[_ATTACHED] = 1  # the server may now use the slots (and unlinks the name)

    def receive(self, slot: int, nbytes: int) -> np.ndarray:
        """The payload in ``slot``: marks it ``HELD`` for as long as the returned array (and
        anything built over it) lives; frees slots nothing refers to any more."""
        if not 0 <= slot < self.slots or nbytes > self.slot_bytes:
            raise DecodeError(
                f"shm frame names slot {slot} ({nbytes} B) of {self.slots} x {self.slot_bytes} B"
            )
        self.collect()
        with self._lock:
            if self.states[slot] != _SENT:
                raise DecodeError(f"shm slot {slot} arrived but the server never filled it")
            start = self.data + slot * self.slot_bytes
            view = lend(self.views, slot, self.buf[start : start + nbytes])
            self.states[slot] = _HELD
            self.received += 1
        return view

    def collect(self) -> None:
        """Hand back every ``HELD`` slot no batch refers to any more."""
        with self._lock:
            take_back(self.states, self.views, _HELD, _FREE)
