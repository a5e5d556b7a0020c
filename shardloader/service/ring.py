"""Token batches forwarded from the server's DataLoader workers to a same-host client, uncopied.

The worker transport (:mod:`shardloader.deliver.transport`, NOTE [ring slots]) already writes each
bundle of token batches into a slot of a :class:`~shardloader.deliver.transport.Ring` that the
DataLoader's process maps.  For a stream whose client shares the host, the server makes that
ring a named shared-memory file (:class:`SharedRing`) which the client maps too (it is
announced with the stream's segment, NOTE [shm handover] in :mod:`shardloader.service.shm`).
The server then sends a bundle's slot number and layout (a few numbers) instead of its bytes,
and the client builds the batches over the same memory, exactly as the local loader does.

NOTE [forwarded slots]: the slot state bytes of the ring get two more owners.
    ``FREE`` -> ``SENT`` (a worker filled it) -> ``ARRIVED`` (unpickled in the server as an
    :class:`Arrived`, no tensor made) -> ``KEPT`` if the server makes it into batches (its own
    views; :meth:`SharedRing.collect` frees it when they are gone, as the local ring does) or,
    when the producer forwards the bundle, ``FORWARDED`` (the server never touches it again)
    -> ``LENT`` when the client decodes it -> ``FREE`` once no tensor of the client refers to
    it (:meth:`RingAttachment.collect`).  Each side frees only the state
    it owns, so neither can hand a slot back that the other still reads; a worker that finds
    no ``FREE`` slot uses fresh shared memory, and that bundle takes the copying path.
    Forked workers only (the default on Linux): they inherit the mapping.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from shardloader.deliver.slots import lend, take_back
from shardloader.deliver.transport import Ring, _build, _rebuild
from shardloader.errors import DecodeError
from shardloader.service.shm import MAX_SLOTS
from shardloader.service.shmfiles import NAME, create_server_file, map_server_file

__all__ = ["Arrived", "RingAttachment", "SharedRing", "ring_maker"]

_FREE, _SENT, _HELD, _KEPT, _FORWARDED, _LENT, _ARRIVED = 0, 1, 2, 3, 4, 5, 6
_MAGIC = b"SLRING01"
_TAIL = 4096  # after the slots: magic and nonce
_FIELDS = 4


class _Mapping:
    """What :class:`Ring` reads its memory from (``.buffer``), here a named file's mapping."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer


def _ring_size(workers: int, slots: int, slot_bytes: int) -> tuple[int, int]:
    head = -(-workers * slots // 64) * 64
    body = head + workers * slots * slot_bytes
    return body, body + _TAIL


class SharedRing(Ring):
    """A :class:`~shardloader.deliver.transport.Ring` in a named shared-memory file a client can
    map."""

    def __init__(self, workers: int, slots: int, slot_bytes: int, folder: str, extra: int) -> None:
        # NOTE: deliberately not Ring.__init__ (an unlinked arena); the layout is Ring's own
        self.id = secrets.token_hex(16)
        slots += extra  # the slots a client holds: its read-ahead, its decoding, its loop
        self.workers, self.slots, self.slot_bytes = workers, slots, slot_bytes
        self.body, self.size = _ring_size(workers, slots, slot_bytes)
        self.file, mm = create_server_file(folder, self.size)
        self.name = self.file.name
        self.nonce = secrets.token_hex(16)
        self.array: Any = _Mapping(mm)
        raw = np.frombuffer(mm, np.uint8)
        raw[self.body : self.body + 8] = np.frombuffer(_MAGIC, np.uint8)
        raw[self.body + 8 : self.body + 24] = np.frombuffer(bytes.fromhex(self.nonce), np.uint8)
        self.received = 0
        self.forwarded = 0
        self._attach()
        from shardloader.deliver.transport import _RINGS

        _RINGS[self.id] = self

    def __getstate__(self) -> dict[str, Any]:
        if __import__("multiprocessing").context.get_spawning_popen() is not None:
            raise TypeError("a SharedRing reaches forked DataLoader workers only")
        return super().__getstate__()

    def announce(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "size": self.size,
            "workers": self.workers,
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "nonce": self.nonce,
        }

    def unlink(self) -> None:
        self.file.unlink()

    # -- in the server's main process -----------------------------------------------------
    received_state = _KEPT  # Ring.receive marks a slot the server itself holds (collect frees)

    def wait_room(self, reserve: int, seconds: float) -> None:
        """Wait (at most ``seconds``) until at most all but ``reserve`` slots are with the
        client: the server then pulls the next bundle only when the workers can write it
        here.  Without this wait the header-only frames would let the server run ahead of
        the client until the ring is full, and the workers would fall back to fresh memory."""
        assert self.states is not None
        flat = self.states.reshape(-1)
        limit = flat.size - reserve
        deadline = 0.0
        while np.count_nonzero(flat >= _FORWARDED) > limit:
            now = time.monotonic()
            if not deadline:
                deadline = now + seconds
            elif now >= deadline:
                return
            time.sleep(0.0002)

    def arrived(self, worker: int, slot: int, nbytes: int, state: tuple[Any, ...]) -> Any:
        """Unpickling a bundle in the server: an :class:`Arrived` (no tensor built yet)."""
        assert self.states is not None
        self.states[worker, slot] = _ARRIVED
        return Arrived(self, worker, slot, nbytes, state)

    def forward(self, item: Arrived) -> dict[str, Any]:
        """The header fields that hand ``item`` to the client; its slot is ``FORWARDED``."""
        assert self.states is not None
        shape, cu_sizes, max_seqlen, _ = item.state
        self.states[item.worker, item.slot] = _FORWARDED
        self.forwarded += 1
        return {
            "ring": [item.worker * self.slots + item.slot, item.nbytes],
            "layout": {
                "shape": [int(x) for x in shape],
                "cu": [int(x) for x in cu_sizes],
                "max": [int(x) for x in max_seqlen],
            },
        }


class Arrived:
    """A bundle of token batches in a slot of a :class:`SharedRing`, as the server's
    DataLoader hands it over: forwarded to the client as it is, or made into batches here
    (:meth:`materialize`) when the client does not map the ring."""

    __slots__ = ("ring", "worker", "slot", "nbytes", "state")

    def __init__(
        self, ring: SharedRing, worker: int, slot: int, nbytes: int, state: tuple[Any, ...]
    ) -> None:
        self.ring, self.worker, self.slot, self.nbytes, self.state = (
            ring,
            worker,
            slot,
            nbytes,
            state,
        )

    @property
    def count(self) -> int:
        return int(self.state[0][1])

    def materialize(self) -> Any:
        """The batch (or :class:`~shardloader.deliver.transport.Bundle`) over the slot, which the
        server then holds as the local loader would (``KEPT`` until its views are gone)."""
        return _rebuild(self.ring.receive(self.worker, self.slot, self.nbytes), self.state)


def ring_maker(
    folder: str, extra: int, claiming: Callable[[int], AbstractContextManager[None]]
) -> Any:
    """The ``make_ring`` of a stream's ShardLoader: a :class:`SharedRing` in ``folder``, made
    ``with claiming(nbytes)`` (an OSError when it may not be: NOTE [unattached reserve] in
    :mod:`shardloader.service.streamshm`)."""

    def make(workers: int, slots: int, slot_bytes: int) -> Ring:
        with claiming(_ring_size(workers, slots + extra, slot_bytes)[1]):
            return SharedRing(workers, slots, slot_bytes, folder, extra)

    return make


class RingAttachment:
    """The client's mapping of a stream's :class:`SharedRing`."""

    def __init__(self, folder: str, announce: dict[str, Any]) -> None:
        try:
            name, size = str(announce["name"]), int(announce["size"])
            workers, slots = int(announce["workers"]), int(announce["slots"])
            slot_bytes = int(announce["slot_bytes"])
            nonce = bytes.fromhex(str(announce["nonce"]))
        except (KeyError, TypeError, ValueError) as err:
            raise DecodeError(f"malformed ring announcement {str(announce)[:200]}") from err
        if (
            not NAME.match(name)
            or not 0 < workers * slots <= 64 * MAX_SLOTS
            or slot_bytes <= 0
            or _ring_size(workers, slots, slot_bytes)[1] != size
        ):
            raise DecodeError(f"malformed ring announcement {str(announce)[:200]}")
        path = os.path.join(folder, name)
        mm = map_server_file(path, size, "ring")
        raw = np.frombuffer(mm, np.uint8)
        body = _ring_size(workers, slots, slot_bytes)[0]
        if raw[body : body + 8].tobytes() != _MAGIC or raw[body + 8 : body + 24].tobytes() != nonce:
            raise FileNotFoundError(f"{path} is not the server's ring")
        n = workers * slots
        head = -(-n // 64) * 64
        self.n, self.slot_bytes, self.raw, self.head = n, slot_bytes, raw, head
        self.states = raw[:n]
        self.views: list[Any] = [None] * n
        self._lock = threading.Lock()

    def batches(self, header: dict[str, Any]) -> list[dict[str, Any]]:
        """The batches of a forwarded bundle, as views into the ring (``LENT`` meanwhile)."""
        ring, layout = header.get("ring"), header.get("layout")
        try:
            i, nbytes = (int(x) for x in ring)  # type: ignore[union-attr]
            shape = tuple(int(x) for x in layout["shape"])  # type: ignore[index]
            cu = tuple(int(x) for x in layout["cu"])  # type: ignore[index]
            longest = tuple(int(x) for x in layout["max"])  # type: ignore[index]
        except (TypeError, ValueError, KeyError) as err:
            raise DecodeError(f"malformed ring frame {str(header)[:200]}") from err
        if (
            not 0 <= i < self.n
            or len(shape) != 4
            or shape[0] != _FIELDS
            or min(shape) <= 0
            or len(cu) != shape[1]
            or len(longest) != shape[1]
            or min(cu) < 1
            or nbytes
            != _FIELDS * shape[1] * shape[2] * shape[3] * 8 + sum(cu) * 4 + shape[1] * shape[2]
            or nbytes > self.slot_bytes
        ):
            raise DecodeError(f"malformed ring frame {str(header)[:200]}")
        self.collect()
        with self._lock:
            if self.states[i] != _FORWARDED:
                raise DecodeError(f"ring slot {i} arrived but the server never forwarded it")
            start = self.head + i * self.slot_bytes
            view = lend(self.views, i, self.raw[start : start + nbytes])
            self.states[i] = _LENT
        return _build(torch.from_numpy(view), shape, cu, longest)  # type: ignore[arg-type]

    def collect(self) -> None:
        with self._lock:
            take_back(self.states, self.views, _LENT, _FREE)
