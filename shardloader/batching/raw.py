"""Batches of raw bytes: :class:`RawCollate` makes a :class:`RawBatch`, one buffer per field.

With ``decoder=None`` every field of a sample is bytes.  As a list of sample dicts a batch
costs a dict and a bytes object per sample to build, and, with DataLoader workers, a pickled
object per sample on its way to the training process.  A :class:`RawBatch` holds each field as
one :class:`ByteColumn`: every sample's bytes end to end in one buffer, plus offsets.  With
``ShardedDataset(..., decoder=None, collate_fn=RawCollate())`` and no transform, the dataset
builds it straight from the shards, without making any per-sample object.

NOTE [RawBatch transport]: a RawBatch crosses from a DataLoader worker to the training process
as byte strings and nothing else: the keys joined by NULs (a key never holds one:
:mod:`shardloader.format.keys`), ``__index__`` and ``__pad__`` as their bytes, and each column as
the samples' bytes objects as the reader made them (or, once joined, its buffer and offsets).  No
dict or other object per sample is pickled, no user object is pickled or unpickled, and the
tensors are rebuilt on arrival.  Deliberately not torch's shared-memory tensors: each of those
sends a file descriptor over a socket to the receiving process, about a millisecond per tensor
on the benchmark machine, longer than copying a whole batch of documents; and not one joined
buffer per column either: joining is one more copy of every byte, and a 1 MB batch of JPEGs
crossed about 15 % faster as its samples' bytes (measured with two workers).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from shardloader.errors import UsageError

__all__ = ["ByteColumn", "RawBatch", "RawCollate", "raw_bundle"]

_SPECIAL = ("__key__", "__index__", "__pad__")
# NOTE [raw bundles]: a DataLoader item costs about 90 us in the worker (queue feeder thread,
# pipe write) and 100 us in the main process (receive, index bookkeeping) whatever its size:
# for batches of 32 documents of 1.5 KB that was 3 us a sample on each side, more than
# reading them.  So a ShardLoader's workers hand raw batches over in bundles of consecutive
# batches (NOTE [bundles] in deliver/transport.py) of about this many bytes; batches this
# large or larger (images) still cross one by one, and the first batch waits for at most
# one bundle's reads.
RAW_BUNDLE_BYTES = 1 << 20
MAX_RAW_BUNDLE = 16  # batches


class ByteColumn(Sequence[Any]):
    """One field of a batch: each sample's bytes end to end in one buffer, and offsets.

    ``column[i]`` is sample ``i``'s bytes (``None`` where the sample lacks the field); iterating
    yields them in order.  For zero-copy access: ``buffer`` (a read-only memoryview of all the
    bytes), ``offsets`` (int64, ``len(column) + 1``: sample ``i`` is
    ``buffer[offsets[i]:offsets[i + 1]]``), ``sizes`` and ``present``; ``tensor()`` is the buffer
    as a uint8 torch tensor (e.g. for ``torchvision.io.decode_jpeg`` on slices of it).

    The dataset builds a column from each sample's bytes as read; the one buffer is made only
    when ``buffer``/``offsets``/``tensor()`` are used or the batch is sent to another process
    (NOTE [RawBatch transport]), so in the process that reads (``num_workers=0``) nothing is
    copied twice: copying memory is much of what reading raw samples costs.
    """

    __slots__ = ("_data", "_offsets", "_present", "_parts")

    def __init__(
        self, data: bytes | memoryview, offsets: np.ndarray, present: np.ndarray | None = None
    ) -> None:
        self._data = data
        self._offsets = offsets
        self._present = present  # None: every sample has the field
        self._parts: list[Any] | None = None  # per sample, before the buffer is made

    @classmethod
    def of(cls, values: Sequence[Any]) -> ByteColumn:
        """A column of ``values`` (bytes-like objects, or None for a missing field), kept as
        they are until the buffer is needed."""
        column = cls(b"", _NO_OFFSETS)
        column._parts = values if isinstance(values, list) else list(values)
        return column

    def _join(self) -> None:
        """Make the one buffer (and offsets, presence) from the parts."""
        if self._parts is None:
            return
        values, self._offsets, self._present = self.pieces()
        self._data = b"".join(values)
        self._parts = None

    def __len__(self) -> int:
        if self._parts is not None:
            return len(self._parts)
        return len(self._offsets) - 1

    @overload
    def __getitem__(self, i: int) -> bytes | None: ...

    @overload
    def __getitem__(self, i: slice) -> list[bytes | None]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} of a column of {n}")
        i %= n
        if self._parts is not None:
            value = self._parts[i]
            return None if value is None else bytes(value)
        if self._present is not None and not self._present[i]:
            return None
        value = self._data[self._offsets[i] : self._offsets[i + 1]]
        return value if type(value) is bytes else bytes(value)

    def __iter__(self) -> Iterator[bytes | None]:
        if self._parts is not None:
            for value in self._parts:
                yield None if value is None else bytes(value)
            return
        data, offsets = self._data, self._offsets.tolist()
        spans = zip(offsets, offsets[1:])  # noqa: B905 - one longer by design
        if self._present is None:
            views: Iterator[Any] = (data[a:b] for a, b in spans)
        else:
            there = self._present.tolist()
            views = (data[a:b] if t else None for (a, b), t in zip(spans, there, strict=True))
        if type(data) is bytes:
            yield from views
        else:  # a view of shared memory (the service's client)
            yield from (None if v is None else bytes(v) for v in views)

    def tolist(self) -> list[bytes | None]:
        return list(self)

    @property
    def buffer(self) -> memoryview:
        self._join()
        return memoryview(self._data).toreadonly()

    @property
    def offsets(self) -> np.ndarray:
        self._join()
        out = self._offsets.view()
        out.flags.writeable = False
        return out

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.pieces()[1])

    @property
    def present(self) -> np.ndarray:
        present = self.pieces()[2]
        return np.ones(len(self), bool) if present is None else present.copy()

    def tensor(self) -> Any:
        """The buffer as a uint8 ``torch.Tensor`` (a copy, so it is writable)."""
        import torch

        self._join()
        return torch.frombuffer(bytearray(self._data), dtype=torch.uint8)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ByteColumn({len(self)} samples, {int(self.sizes.sum()):,} bytes)"

    def __reduce__(self) -> tuple[Any, ...]:
        parts = self._parts
        if parts is not None:  # NOTE [RawBatch transport]: the samples' bytes as they are
            return ByteColumn.of, (
                [v if v is None or type(v) is bytes else bytes(v) for v in parts],
            )
        present = None if self._present is None else self._present.tobytes()
        return _column, (bytes(self._data), self._offsets.tobytes(), present)

    def pieces(self) -> tuple[list[Any], np.ndarray, np.ndarray | None]:
        """(the bytes-like values end to end, offsets, presence or None when every sample has
        the field), without joining them into one buffer first: for a writer that copies
        them somewhere anyway (the service's frames)."""
        parts = self._parts
        if parts is None:
            return [self._data], self._offsets, self._present
        n = len(parts)
        offsets = np.zeros(n + 1, np.int64)
        if parts.count(None):
            present = np.fromiter((v is not None for v in parts), bool, n)
            sizes = np.fromiter((0 if v is None else len(v) for v in parts), np.int64, n)
            np.cumsum(sizes, out=offsets[1:])
            return [v for v in parts if v is not None], offsets, present
        np.cumsum(np.fromiter(map(len, parts), np.int64, n), out=offsets[1:])
        return parts, offsets, None


_NO_OFFSETS = np.zeros(1, np.int64)


def _column(data: bytes, offsets: bytes, present: bytes | None) -> ByteColumn:
    return ByteColumn(
        data,
        np.frombuffer(offsets, np.int64),
        None if present is None else np.frombuffer(present, bool),
    )


def raw_bundle(dataset: Any) -> int:
    """Batches per worker output for ``dataset`` (NOTE [raw bundles]): more than 1 only when
    its batches are built straight from the shards as :class:`RawBatch` es (``decoder=None``,
    ``collate_fn=RawCollate()``, ``batch_size``, no transform) and hold under
    :data:`RAW_BUNDLE_BYTES` by the dataset's mean sample."""
    if not (
        isinstance(dataset.collate_fn, RawCollate)
        and dataset.decoder is None
        and dataset.transform is None
        and dataset.batch_size is not None
        and dataset.planner is None
    ):
        return 1
    manifest = dataset.manifest
    mean = sum(s.raw_bytes for s in manifest.shards) / max(manifest.num_samples, 1)
    per_batch = max(mean * dataset.batch_size, 1.0)
    return int(min(MAX_RAW_BUNDLE, max(1, RAW_BUNDLE_BYTES // per_batch)))


class RawBatch(dict):  # type: ignore[type-arg]
    """A batch of raw samples, as :class:`RawCollate` and the dataset build it.

    ``batch["__key__"]``: the samples' keys (a list of str); ``batch["__index__"]`` their global
    ids and ``batch["__pad__"]`` whether each is a repeat (int64 and bool tensors, as
    torch's default collate gives them); every field a :class:`ByteColumn`.  Values a
    transform added that are not bytes are collated as :func:`~shardloader.collate.
    collate_samples` does.  A plain ``dict`` otherwise; NOTE [RawBatch transport] says how it
    crosses processes.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        parts: dict[str, Any] = {}
        other: dict[str, Any] = {}
        for name, value in self.items():
            if name == "__key__" and _joinable(value):
                parts[name] = "\0".join(value)
            elif name in ("__index__", "__pad__") and _plain_tensor(value):
                array = value.numpy()
                parts[name] = (array.dtype.str, array.tobytes())
            else:
                other[name] = value
        return _batch, (parts, other, list(self))


def _joinable(keys: Any) -> bool:
    return (
        isinstance(keys, list)
        and bool(keys)
        and all(isinstance(k, str) for k in keys)
        and "\0" not in "".join(keys)
    )


def _plain_tensor(value: Any) -> bool:
    import torch

    return (
        isinstance(value, torch.Tensor)
        and value.dtype in (torch.int64, torch.bool)
        and value.ndim == 1
        and value.device.type == "cpu"
        and not value.requires_grad
    )


def _batch(parts: dict[str, Any], other: dict[str, Any], order: list[str]) -> RawBatch:
    import torch

    values: dict[str, Any] = dict(other)
    for name, part in parts.items():
        if name == "__key__":
            values[name] = part.split("\0")
        else:
            dtype, data = part
            values[name] = torch.from_numpy(np.frombuffer(data, dtype).copy())
    return RawBatch((name, values[name]) for name in order)


@dataclass(frozen=True)
class RawCollate:
    """``collate_fn`` for raw bytes: each batch a :class:`RawBatch` (one buffer per field).

    Pass it with ``decoder=None``; without a transform the dataset then builds each batch
    straight from the shards, with no per-sample objects (the fastest way to read raw bytes,
    also across DataLoader workers: NOTE [RawBatch transport]).  Called on a list of sample
    dicts (with a transform, or by itself) it collates them: bytes fields (and fields some
    samples lack) into :class:`ByteColumn`s, ``__key__`` into a list, everything else as
    :func:`~shardloader.collate.collate_samples` does.
    """

    columns = True  # the dataset may hand it columns instead of sample dicts

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> RawBatch:
        from shardloader.batching.default import _collate_dicts, _stacker

        if not samples:
            raise UsageError("cannot collate an empty batch")
        names = list(dict.fromkeys(name for s in samples for name in s))
        out = RawBatch()
        for name in names:
            values = [s.get(name) for s in samples]
            if name == "__key__":
                out[name] = values
            elif all(v is None or isinstance(v, (bytes, bytearray, memoryview)) for v in values):
                out[name] = ByteColumn.of(values)
            elif any(v is None for v in values):
                raise UsageError(
                    f"field {name!r} is missing from some samples of the batch and is not bytes; "
                    "RawCollate keeps missing values only in bytes fields"
                )
            else:
                got = _collate_dicts(
                    [{name: v} for v in values], samples, "", {}, _stacker("error")
                )
                out[name] = got[name]
        return out
