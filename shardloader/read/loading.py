"""Loading in the worker: read a batch → decode (allowlist) → transform, and the skip rule.

A batch is read shard by shard in one pass (:meth:`ShardSet.read_batch`); raw batches for
:class:`~shardloader.batching.raw.RawCollate` go straight into columns (:meth:`load_raw`).

Every error on the way names shard, sample key, rank and worker and is chained to the original
(``raise ... from err``); under ``on_error="skip"`` a bad sample is replaced by a repeat of a
good one of the same batch, so batch shapes and step counts never change.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.batching.raw import ByteColumn, RawBatch
from shardloader.codecs.allowlist import Decoder, decode_field
from shardloader.errors import (
    DecodeError,
    ShardError,
    ShardloaderError,
    StorageError,
    TransformError,
    UsageError,
)
from shardloader.format.base import Rows
from shardloader.plan.split import Place
from shardloader.read.fields import FieldMap, complete
from shardloader.read.shardset import ShardSet

__all__ = ["SampleLoader", "pipeline_draws"]

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
    # told of every sample on_error="skip" replaces: (place, sample id, key, error); the
    # dataset passes its SkipLog's record of the epoch here (shardloader/read/skips.py)
    on_skip: Callable[[Place, int, str, BaseException], None] | None = None

    @property
    def takes_generator(self) -> bool:
        """Whether the transform wants the batch's generator (shardloader's own do)."""
        return bool(getattr(self.transform, "takes_generator", False))

    def load_batch(
        self,
        shards: ShardSet,
        ids: np.ndarray,
        rows: Rows,
        pads: np.ndarray,
        place: Place,
        generator: Any = None,
    ) -> tuple[list[dict[str, Any]], np.ndarray]:
        """Read, decode and transform one batch's samples, in planned order; also say which
        samples stand in for bad ones.  ``generator`` (the batch's ``torch.Generator``) goes
        to a transform that declares ``takes_generator`` (NOTE [transform generators] in
        :mod:`shardloader.vision.transforms`).

        ``rows``: the batch as read, shard by shard in one pass, with the next batches
        (:meth:`ShardSet.read_batch` in ``samplepass._read_ahead``).  Under
        ``on_error="skip"`` a bad sample is replaced by a repeat of a good one from the same
        batch, flagged ``__pad__``, so batch shapes and step counts never change.
        """
        out: list[dict[str, Any] | None] = []
        errors = dict(rows.errors)
        columns = list(rows.fields.items())
        for pos, pad in enumerate(pads.tolist()):
            err = errors.get(pos)
            if err is None:
                raw = {name: bytes(col[pos]) for name, col in columns if col[pos] is not None}
                try:
                    out.append(
                        self.build_sample(shards, ids, pos, rows.keys[pos], raw, pad, generator)
                    )
                    continue
                except (ShardError, DecodeError, StorageError) as failed:
                    err = errors[pos] = failed
            if self.on_error == "raise":
                raise err
            out.append(None)
        substituted = np.array([s is None for s in out], bool)
        good = [s for s in out if s is not None]
        if not errors:
            return good, substituted
        if not self._stand_in(errors, ids, rows.keys, place, len(out) == 1):
            return [], substituted[:0]  # unbatched: the step is skipped
        return [
            s if s is not None else {**good[i % len(good)], "__pad__": True}
            for i, s in enumerate(out)
        ], substituted

    def load_raw(
        self,
        shards: ShardSet,
        ids: np.ndarray,
        rows: Rows,
        pads: np.ndarray,
        place: Place,
    ) -> RawBatch:
        """One batch of raw samples (``decoder=None``, no transform) as a :class:`RawBatch`,
        straight from the shards: no per-sample dict or bytes object is made.

        ``on_error`` works as in :meth:`load_batch`: a bad sample raises, or is replaced by a
        repeat of a good one of the batch (its key, id and fields), flagged in ``__pad__``.
        """
        import torch

        keys, errors = rows.keys, dict(rows.errors)
        columns: dict[str, list[Any]] = {}
        member_of = self.field_map.member_of
        for ext, values in rows.fields.items():
            name = member_of.get(ext, ext) if member_of else ext
            if self.field_map.projected and name not in self.field_map.fields:
                continue  # ReadOptions.fields leaves it out
            if name not in columns:
                columns[name] = values
                continue
            into = columns[name]  # aliases: key.jpg and key.png both fill "image"
            for pos, value in enumerate(values):
                if value is None or pos in errors:
                    continue
                if into[pos] is None:
                    into[pos] = value
                    continue
                # a sample with both is an error (as in build_sample)
                exts = [e for e, n in member_of.items() if n == name]
                err = errors[pos] = self.field_map.clash(dict.fromkeys(exts, b""), name)
                err.where = _located_at(shards, ids, pos, keys[pos])
                into[pos] = None
        ids, pads = ids.copy(), pads.copy()
        if errors:
            if self.on_error == "raise":
                raise errors[min(errors)]
            good = self._stand_in(errors, ids, keys, place)
            for pos in sorted(errors):
                src = good[pos % len(good)]
                keys[pos], ids[pos], pads[pos] = keys[src], ids[src], True
                for values in columns.values():
                    values[pos] = values[src]
        batch = RawBatch(
            __key__=keys,
            __index__=torch.from_numpy(ids),
            __pad__=torch.from_numpy(pads),
        )
        for name, values in columns.items():
            batch[name] = ByteColumn.of(values)
        return batch

    def _stand_in(
        self,
        errors: dict[int, ShardloaderError],
        ids: np.ndarray,
        keys: list[str],
        place: Place,
        empty_ok: bool = False,
    ) -> list[int]:
        """``on_error="skip"``: log and record each bad sample; the positions of the good ones
        that stand in for them (none only when ``empty_ok``: an unbatched step is skipped)."""
        bad = sorted(errors)
        for pos in bad:
            log.warning("skipping sample %d (%s): %s", int(ids[pos]), place, errors[pos])
            if self.on_skip is not None:
                self.on_skip(place, int(ids[pos]), str(keys[pos]), errors[pos])
        good = [pos for pos in range(len(ids)) if pos not in errors]
        if not good and not empty_ok:
            last = errors[bad[-1]]
            raise ShardError(
                f"every sample of a batch failed ({place}); last error: {last}"
            ) from last
        return good

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

    def build_sample(
        self,
        shards: ShardSet,
        ids: np.ndarray,
        pos: int,
        key: str,
        raw: Mapping[str, bytes],
        pad: bool,
        generator: Any = None,
    ) -> dict[str, Any]:
        """Decode and transform sample ``pos`` of the batch ``ids`` (its raw fields ``raw``).

        Every error on the way names shard, sample key, rank and worker and is chained to the
        original: shardloader's own errors keep their class (a DecodeError stays one, so
        ``on_error="skip"`` skips an image a transform cannot decode), anything else a
        transform raises becomes a :class:`TransformError`.
        """
        try:
            sample = self._decoded(key, int(ids[pos]), raw, pad)
            return sample if self.transform is None else self._transformed(sample, generator)
        except ShardloaderError as err:
            if err.where is None:  # the place is worked out only for a sample that fails
                err.where = _located_at(shards, ids, pos, key)
            raise

    def _decoded(self, key: str, gid: int, raw: Mapping[str, bytes], pad: bool) -> dict[str, Any]:
        """The sample dict of raw fields ``raw``: members under their field, decoded, filled."""
        sample: dict[str, Any] = {"__key__": key, "__index__": gid, "__pad__": pad}
        member_of = self.field_map.member_of  # aliases: key.png fills "image"
        for ext, data in raw.items():
            name = member_of.get(ext, ext) if member_of else ext
            if self.field_map.projected and name not in self.field_map.fields:
                continue  # ReadOptions.fields leaves it out
            if member_of and name in sample:
                raise self.field_map.clash(raw, name)
            sample[name] = data if self.decoder is None else self.decode(name, ext, data)
        for name in self.field_map.fields:  # NOTE [missing values]: every batch has each field
            if name not in sample:
                sample[name] = None
        if self.decoder is not None and (self.decoder.fill or self.decoder.required):
            complete(sample, self.decoder.fill, self.decoder.required)
        return sample

    def _transformed(self, sample: dict[str, Any], generator: Any) -> dict[str, Any]:
        """The transform's sample; what it raises is chained to a shardloader error."""
        assert self.transform is not None
        try:
            if generator is not None and self.takes_generator:
                out = self.transform(sample, generator=generator)
            else:
                out = self.transform(sample)
        except Exception as err:  # user code: anything at all
            raise _recast(err) from err
        if not isinstance(out, Mapping):
            raise UsageError(
                f"transform returned {type(out).__name__}; it must return the sample dict "
                "(filtering in a transform would make ranks uneven)"
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


def _located_at(shards: ShardSet, ids: np.ndarray, pos: int, key: str) -> str:
    """Shard, sample key, rank and worker of sample ``pos`` of the batch ``ids`` (its shard
    found from its id): built only when an error needs it."""
    shard = int(shards.locate(ids[pos : pos + 1])[0][0])
    return f"{shards.describe(shard)}, sample {key!r}"


def _recast(err: Exception) -> ShardloaderError:
    """A transform's ``err`` as a fresh error to chain it to: its own class if it is one of
    ours (a DecodeError stays one, so ``on_error="skip"`` skips it), else a TransformError."""
    if isinstance(err, ShardloaderError):
        try:
            return type(err)(str(err))
        except TypeError:  # a subclass with another constructor
            pass
    return TransformError(f"transform raised {type(err).__name__}: {err}")


def pipeline_draws(transform: Any, decoder: Decoder | None, collate_fn: Any) -> bool:
    """Whether a pipeline runs code that may draw from the global RNGs (torch, numpy,
    ``random``): a transform, custom decoders, or a collate that is not shardloader's own.

    The dataset seeds the global RNGs per batch only then (NOTE [what the global seeds are
    for] in :mod:`shardloader.dataset`), and the service lets such pipelines take turns (NOTE
    [serial pipeline] in :mod:`shardloader.service.stream`).  Shardloader's collates and the
    default decoding draw nothing, and the transforms of :mod:`shardloader.vision` draw only
    from the per-batch generator the dataset hands them (NOTE [transform generators]).
    """
    if transform is not None and not _own_transform(transform):
        return True
    if decoder is not None and decoder.custom:
        return True
    if collate_fn is None:
        return False
    fn = collate_fn.func if isinstance(collate_fn, functools.partial) else collate_fn
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return not module.startswith("shardloader.")


def _own_transform(t: Any) -> bool:
    """``t`` is one of shardloader's transforms, and so is all it wraps (``Compose.transforms``,
    ``ApplyTo.transform``): they draw only from the generator they are handed, never from the
    global RNGs (NOTE [transform generators])."""
    if not getattr(type(t), "__module__", "").startswith("shardloader."):
        return False
    inner = list(getattr(t, "transforms", ()))
    if getattr(t, "transform", None) is not None:
        inner.append(t.transform)
    return all(_own_transform(x) for x in inner)
