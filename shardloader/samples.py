"""Per-sample loading in the worker: read → decode (allowlist) → transform, and the skip rule.

Every error on the way names shard, sample key, rank and worker and is chained to the original
(``raise ... from err``); under ``on_error="skip"`` a bad sample is replaced by a repeat of a
good one of the same batch, so batch shapes and step counts never change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.aliases import FieldMap
from shardloader.codecs import Decoder, decode_field
from shardloader.errors import (
    DecodeError,
    ShardError,
    ShardloaderError,
    StorageError,
    TransformError,
    UsageError,
)
from shardloader.shards import ShardSet
from shardloader.split import Place

__all__ = ["SampleLoader"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleLoader:
    """How a worker turns planned sample ids into sample dicts (built per pass, in the worker).

    ``lengths`` (by global id) and ``length_field`` are the plan's, for cutting segment
    batches (:meth:`cut_segments`).
    """

    field_map: FieldMap
    decoder: Decoder | None
    transform: Callable[..., Any] | None  # called with generator= if it takes_generator
    on_error: str
    length_field: str | None = None
    lengths: np.ndarray | None = None

    @property
    def takes_generator(self) -> bool:
        """Whether the transform wants the batch's generator (shardloader's own do)."""
        return bool(getattr(self.transform, "takes_generator", False))

    def load_batch(
        self,
        shards: ShardSet,
        ids: np.ndarray,
        pads: np.ndarray,
        place: Place,
        generator: Any = None,
    ) -> tuple[list[dict[str, Any]], np.ndarray]:
        """Read, decode and transform one batch's samples, in planned order; also say which
        samples stand in for bad ones.  ``generator`` (the batch's ``torch.Generator``) goes
        to a transform that declares ``takes_generator`` (NOTE [transform generators] in
        :mod:`shardloader.vision.transforms`).

        Under ``on_error="skip"`` a bad sample is replaced by a repeat of a good one from the
        same batch, flagged ``__pad__``, so batch shapes and step counts never change.
        """
        shard_of, local_of = shards.locate(ids)
        out: list[dict[str, Any] | None] = []
        last_error: ShardloaderError | None = None
        for gid, shard, local, pad in zip(ids, shard_of, local_of, pads, strict=False):
            try:
                out.append(
                    self.load_sample(shards, int(shard), int(local), int(gid), bool(pad), generator)
                )
            except (ShardError, DecodeError, StorageError) as err:
                if self.on_error == "raise":
                    raise
                log.warning("skipping sample %d (%s): %s", int(gid), place, err)
                out.append(None)
                last_error = err
        good = [s for s in out if s is not None]
        substituted = np.array([s is None for s in out], bool)
        if last_error is None:
            return good, substituted
        if not good:
            if len(out) == 1:
                return [], substituted[:0]  # unbatched: the step is skipped
            raise ShardError(
                f"every sample of a batch failed ({place}); last error: {last_error}"
            ) from last_error
        return [
            s if s is not None else {**good[i % len(good)], "__pad__": True}
            for i, s in enumerate(out)
        ], substituted

    def cut_segments(
        self,
        batch: np.ndarray,
        ids: np.ndarray,
        samples: list[dict[str, Any]],
        substituted: np.ndarray,
        place: Place,
    ) -> list[dict[str, Any]]:
        """One sample per segment of a ``[k, 3]`` batch, the length field cut to the segment.

        The plan cut documents by the lengths the manifest records, so the field must still
        have that length after the transform.  A stand-in for a bad sample (``on_error="skip"``)
        is tiled to the bad sample's length, so the batch keeps its planned rows.
        """
        field = self.length_field
        assert field is not None and self.lengths is not None  # checked by resolve_collate
        tokens_of: dict[int, tuple[dict[str, Any], Any]] = {}
        for gid, sample, stand_in in zip(ids.tolist(), samples, substituted.tolist(), strict=True):
            tokens = sample.get(field)
            if tokens is None:
                raise UsageError(
                    f"sample {sample.get('__key__')!r} ({place}) has no field {field!r} to cut "
                    f"into the planned segments (fields: {', '.join(map(str, sample))})"
                )
            planned = int(self.lengths[gid])
            if len(tokens) != planned:
                if not stand_in:
                    raise UsageError(
                        f"sample {sample.get('__key__')!r} ({place}): field {field!r} holds "
                        f"{len(tokens)} tokens but the manifest records {planned}, and the plan "
                        "cut it by the recorded length; a transform must not change the token "
                        "count (add special tokens when packing, or in the collate)"
                    )
                tokens = np.resize(np.asarray(tokens), planned)
            tokens_of[gid] = (sample, tokens)
        out = []
        for gid, start, stop in batch.tolist():
            sample, tokens = tokens_of[gid]
            out.append({**sample, field: tokens[start:stop], "__span__": (start, stop)})
        return out

    def load_sample(
        self, shards: ShardSet, shard: int, local: int, gid: int, pad: bool, generator: Any = None
    ) -> dict[str, Any]:
        """Read, decode and transform one sample.

        Every error on the way names shard, sample key, rank and worker and is chained to the
        original: shardloader's own errors keep their class (a DecodeError stays one, so
        ``on_error="skip"`` skips an image a transform cannot decode), anything else a
        transform raises becomes a :class:`TransformError`.
        """
        key, raw = shards.read(shard, local)
        sample: dict[str, Any] = {"__key__": key, "__index__": gid, "__pad__": pad}
        member_of = self.field_map.member_of  # aliases: key.png fills "image"
        for ext, data in raw.items():
            name = member_of.get(ext, ext) if member_of else ext
            if member_of and name in sample:
                err = self.field_map.clash(raw, name)
                raise ShardError(f"{_where(shards, shard, key)}: {err}") from err
            if self.decoder is None:
                sample[name] = data
                continue
            try:
                sample[name] = self.decode(name, ext, data)
            except DecodeError as err:
                raise DecodeError(f"{_where(shards, shard, key)}: {err}") from err
        if self.transform is None:
            return sample
        try:
            if generator is not None and self.takes_generator:
                out = self.transform(sample, generator=generator)
            else:
                out = self.transform(sample)
        except Exception as err:  # user code: anything at all
            raise _located(err, _where(shards, shard, key)) from err
        if not isinstance(out, Mapping):
            raise UsageError(
                f"{_where(shards, shard, key)}: transform returned {type(out).__name__}; it "
                "must return the sample dict (filtering in a transform would make ranks uneven)"
            )
        return dict(out)

    def decode(self, name: str, ext: str, data: bytes) -> Any:
        assert self.decoder is not None
        info = self.field_map.fields.get(name)
        codec = info.codec if info is not None else "bytes"
        try:
            return decode_field(
                name, codec, data, self.decoder, dtype=info.dtype if info else None, member=ext
            )
        except DecodeError:
            raise
        except Exception as err:  # corrupt payloads surface as many library types
            member = f" (member .{ext})" if ext != name else ""
            raise DecodeError(f"cannot decode field {name!r}{member} as {codec}: {err}") from err


def _where(shards: ShardSet, shard: int, key: str) -> str:
    """Shard, sample key, rank and worker: built only when an error needs it."""
    return f"{shards.describe(shard)}, sample {key!r}"


def _located(err: Exception, where: str) -> ShardloaderError:
    """``err`` with the sample's place in front: its own class if it is one of ours."""
    if isinstance(err, ShardloaderError):
        try:
            return type(err)(f"{where}: {err}")
        except TypeError:  # a subclass with another constructor
            pass
    return TransformError(f"{where}: transform raised {type(err).__name__}: {err}")
