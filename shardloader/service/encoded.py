"""Batches a stream's DataLoader workers encode straight into the client's shared memory.

Without this, a worker pickles each batch through a pipe to the server (the DataLoader's
transport: for raw bytes every sample's bytes, NOTE [RawBatch transport]), and the server then
copies it once more into a shared slot for the client: the server does the work of the local
loader's training process and then some.  For a same-host client whose stream has DataLoader
workers, the stream gives the DataLoader :class:`EncodeInWorker` as its ``collate_fn`` (which
torch runs in the worker, on the dataset's finished batch): once the client has mapped the
stream's segment, the worker encodes the batch (:func:`~shardloader.service.wire.encode_placed`)
into a free slot of its own share of the segment and hands the server an :class:`Encoded` (the
frame header's fields: a few numbers and the batch's structure); the server adds the step and
sends the header.  Before the client attaches, or when the worker's slots are all with the
client, the worker returns the batch as it is and the server takes the usual road.

The segment is made before the workers start, so its slots are sized from the first batch of
the streams before (``Metrics.frame_hint``, half as large again); a stream's first batches,
and any batch too large for a slot, take the server's road.

NOTE [worker slots]: worker ``w`` of ``K`` takes only slots ``w*S .. w*S+S-1`` of the segment
and the server only the last ``S`` (:attr:`Segment.mine`), so no two processes ever take the
same ``FREE`` slot; the client frees slots exactly as for the server's own (NOTE [shm
handover]).  Forked workers only (the default on Linux): they inherit the mapping.
"""

from __future__ import annotations

from typing import Any

from shardloader.service.shm import Segment
from shardloader.service.wireencode import encode_placed

__all__ = ["Encoded", "EncodeInWorker"]


class Encoded:
    """A batch a worker encoded into shared memory: its frame header's fields."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __reduce__(self) -> tuple[Any, ...]:
        return Encoded, (self.fields,)  # plain dicts, lists, str and int: the header

    @property
    def count(self) -> int:
        trees = self.fields.get("trees")
        return len(trees) if isinstance(trees, list) else 1


class EncodeInWorker:
    """The ``collate_fn`` of a stream's DataLoader (NOTE [worker slots])."""

    def __init__(self, segment: Segment, per_worker: int) -> None:
        self.segment, self.per_worker = segment, per_worker

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("EncodeInWorker reaches forked DataLoader workers only")

    def __call__(self, batch: Any) -> Any:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        segment = self.segment
        if info is None or not segment.attached:
            return batch
        lo = info.id * self.per_worker
        fields = encode_placed(
            [batch], lambda nbytes: segment.take(lo, lo + self.per_worker, nbytes)
        )
        return batch if fields is None else Encoded(fields)
