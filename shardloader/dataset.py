"""``ShardedDataset``: an IterableDataset that composes order, split, shards and decoding.

Guarantees (see DESIGN.md and README "Guarantees"): every sample exactly once per epoch across
ranks × workers (plus reported padding), the same number of steps on every rank, the same
sequence per rank whatever ``num_workers`` is, elastic and instant resume through
:func:`shardloader.make_loader`, and augmentation seeded per step.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import multiprocessing.context
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from shardloader.aliases import FieldMap
from shardloader.batching.base import PlanReport, batch_ids, signature_of, stable_value
from shardloader.batching.fixed import FixedBatches, account_fixed
from shardloader.codecs import Decoder, decode_field
from shardloader.errors import (
    DecodeError,
    ShardError,
    ShardloaderError,
    StorageError,
    TransformError,
    UsageError,
)
from shardloader.manifest import SampleIndex, read_manifest
from shardloader.shards import ReadOptions, ShardSet, working_set_bytes
from shardloader.shuffle import ShuffleOptions, derive_seed, epoch_order, plan_rng, seed_global_rngs
from shardloader.split import UNEVEN_POLICIES, BatchSlots, Place, cut_fixed_batches, rank_slots
from shardloader.storage import join, read_bytes
from shardloader.world import detect_place, detect_world

__all__ = ["ShardedDataset", "EpochReport"]

log = logging.getLogger(__name__)

_EPOCH, _START, _RANK, _WORLD = range(4)
_DEFAULT_DECODER = Decoder()


@dataclass(frozen=True)
class EpochReport:
    """What one epoch looks like for this world size: steps per rank, what was evened out, and
    where every token of the epoch goes.

    Samples: ``padded_samples`` are repeats added so every batch and rank is full (flagged
    ``__pad__``); ``dropped_samples`` are left out entirely and ``truncated_samples`` in part, by
    any policy (the planner's tail, oversize and long-document rules, ``uneven="drop"``, a
    PadCollate's ``max_length`` with fixed batches).  Tokens count the manifest's length field
    (``None`` without one): ``tokens`` delivered, each once; ``truncated_tokens`` and
    ``dropped_tokens`` cut from truncated and dropped samples, so the three add up to
    ``total_tokens``, every token of the epoch; ``repeated_tokens`` delivered again in repeats;
    ``token_slots`` the positions all steps of all ranks allocate (``pad_fraction``: the share
    of them that is padding).
    """

    epoch: int
    num_samples: int
    steps_per_rank: int
    padded_samples: int  # duplicates added so every batch and rank is full
    dropped_samples: int  # samples of which nothing is delivered
    truncated_samples: int = 0  # samples of which only a part is delivered
    tokens: int | None = None
    truncated_tokens: int | None = None
    dropped_tokens: int | None = None
    repeated_tokens: int | None = None
    token_slots: int | None = None

    @property
    def total_tokens(self) -> int | None:
        """Every token of the epoch's samples: delivered + truncated + dropped."""
        if self.tokens is None:
            return None
        return self.tokens + (self.truncated_tokens or 0) + (self.dropped_tokens or 0)

    @property
    def pad_fraction(self) -> float | None:
        """Share of the allocated token slots that is padding."""
        if self.tokens is None or not self.token_slots:
            return None
        return 1.0 - (self.tokens + (self.repeated_tokens or 0)) / self.token_slots


@dataclass(frozen=True)
class _Plan:
    order: np.ndarray
    batches: list[np.ndarray]
    slots: BatchSlots
    pad_in_last: int  # padding samples at the end of the last global batch
    dropped: int  # samples cut from a partial last batch
    num_batches: int
    start: int  # first global batch of this (possibly resumed) pass


class _Control:
    """Epoch, resume position, rank and world, readable by DataLoader workers.

    NOTE [why shared memory here]: with ``persistent_workers=True`` torch keeps the dataset
    copy the workers got at start, so ``set_epoch`` in the main process would never reach them.
    Four int64s in an anonymous shared array (inherited by workers, gone with the processes,
    nothing named to leak) carry it.  Outside process start-up the dataset pickles a snapshot.
    """

    def __init__(self, values: list[int]) -> None:
        self.array: Any = multiprocessing.RawArray("q", values)

    def get(self) -> list[int]:
        return list(self.array)

    def set(self, index: int, value: int) -> None:
        self.array[index] = value

    def __getstate__(self) -> dict[str, Any]:
        if multiprocessing.context.get_spawning_popen() is not None:
            return {"array": self.array}
        return {"values": list(self.array)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "array" in state:
            self.array = state["array"]
        else:
            self.array = multiprocessing.RawArray("q", state["values"])


class ShardedDataset(IterableDataset):  # type: ignore[type-arg]
    """Stream a packed dataset (local folder or any fsspec URL) into PyTorch.

    ``batch_size`` forms batches inside the workers (needed for the guarantee that a rank's
    sequence does not depend on ``num_workers``); ``planner`` replaces fixed batches with
    bucketing, token budgets or packing.  ``uneven`` says how ranks are evened out: ``"pad"``
    repeats samples, ``"drop"`` leaves them out; :meth:`report` gives the numbers.

    The planner decides the collate where it must agree with the plan (its
    ``resolve_collate``): ``PackedBatches(..., pad_id=...)`` builds its PackCollate when
    ``collate_fn`` is left out, and a PackCollate or PadCollate whose options disagree with the
    planner is refused.  Segment batches (see :mod:`shardloader.batching`) reach the collate as
    one sample per segment, the length field cut to the segment.
    """

    def __init__(
        self,
        url: str,
        *,
        batch_size: int | None = None,
        planner: Any = None,
        shuffle: bool | ShuffleOptions = False,
        seed: int = 0,
        uneven: str = "pad",
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        collate_fn: Callable[[list[dict[str, Any]]], Any] | None = None,
        decoder: Decoder | None = _DEFAULT_DECODER,
        on_error: str = "raise",
        rank: int | None = None,
        world_size: int | None = None,
        read: ReadOptions | None = None,
        aliases: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        super().__init__()
        if uneven not in UNEVEN_POLICIES:
            raise UsageError(f"uneven={uneven!r} is not one of {UNEVEN_POLICIES}")
        if on_error not in ("raise", "skip"):
            raise UsageError(f"on_error={on_error!r} is not 'raise' or 'skip'")
        if batch_size is not None and planner is not None:
            raise UsageError("pass batch_size or planner, not both")
        if batch_size is not None and batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, got {batch_size}")
        self.url = url
        self.read_options = read or ReadOptions()
        self.manifest, self.base = read_manifest(
            url, self.read_options.storage_options, policy=self.read_options.retry
        )
        if self.manifest.num_samples == 0:
            raise UsageError(f"{url} holds no samples")
        self.batch_size = batch_size
        self.planner = planner
        self.shuffle = shuffle if isinstance(shuffle, ShuffleOptions) else ShuffleOptions(shuffle)
        self.seed = int(seed)
        self.uneven = uneven
        self.transform = transform
        resolve = getattr(planner, "resolve_collate", None)
        self.collate_fn = (
            collate_fn if resolve is None else resolve(collate_fn, self.manifest.length_field)
        )
        self.decoder = decoder
        self.on_error = on_error
        # member extension → logical field: the manifest's aliases, ``aliases`` merged over
        self.field_map = FieldMap.of_manifest(self.manifest, aliases)
        _signature(planner, batch_size, self.shuffle, uneven)  # a planner must declare options
        self._explicit_world = (rank, world_size)
        r, w = detect_world(rank, world_size)
        Place(r, w)  # validate
        self._control = _Control([0, 0, r, w])
        self._lengths: np.ndarray | None = None
        if planner is not None and getattr(planner, "needs_lengths", False):
            self._lengths = self._load_lengths()
        # len() of the last (epoch, start, rank, world) asked for: the loader checks every
        # pass against it; lengths loaded only for report(), never pickled into workers
        self._len_cache: tuple[tuple[int, ...], int] | None = None
        self._report_lengths: tuple[np.ndarray | None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_report_lengths"] = None
        return state

    # -- public state ---------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._control.get()[_EPOCH]

    @property
    def rank(self) -> int:
        return self._control.get()[_RANK]

    @property
    def world_size(self) -> int:
        return self._control.get()[_WORLD]

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (reshuffles); keeps a loaded resume position for that same epoch."""
        if epoch != self.epoch:
            self._control.set(_START, 0)
        self._control.set(_EPOCH, int(epoch))

    def seek(self, epoch: int, position: int) -> None:
        """Start the next pass of ``epoch`` after ``position`` global batches (all ranks).

        A rank's ``j``-th step of an epoch is global batch ``j * world_size + rank``, so to
        continue every rank at step ``j`` seek to ``position = j * world_size``.
        """
        if position < 0:
            raise UsageError(f"position must be >= 0, got {position}")
        self._control.set(_EPOCH, int(epoch))
        self._control.set(_START, int(position))

    def for_rank(self, rank: int, world_size: int) -> ShardedDataset:
        """A copy of this dataset (same manifest, seed, plan) that reads as ``rank``."""
        Place(rank, world_size)
        clone = copy.copy(self)
        clone._explicit_world = (rank, world_size)
        clone._control = _Control([self.epoch, 0, rank, world_size])
        return clone

    def refresh_world(self) -> None:
        """Re-detect rank/world (call after ``init_process_group``; make_loader does)."""
        r, w = detect_world(*self._explicit_world)
        self._control.set(_RANK, r)
        self._control.set(_WORLD, w)

    @property
    def plan_signature(self) -> str:
        """What must stay equal for a saved position to mean the same samples: the planner's
        declared options (NOTE [plan signature] in :mod:`shardloader.batching.base`), shuffle
        and ``uneven``; ``fixed(N)`` stands for ``batch_size=N``."""
        return _signature(self.planner, self.batch_size, self.shuffle, self.uneven)

    def report(self, epoch: int | None = None) -> EpochReport:
        """Steps per rank, samples padded/dropped/truncated and where every token goes (all
        ranks together) for an epoch; plans the epoch, reads nothing but the sidecar lengths."""
        e = self.epoch if epoch is None else epoch
        start = self._control.get()[_START] if e == self.epoch else 0
        plan = self._plan(e, start, self.rank, self.world_size)
        s, n = plan.slots, plan.num_batches
        # what all ranks' steps deliver: batches up to those uneven="drop" leaves out, and the
        # batches repeated from the epoch's start to even out the ranks under "pad"
        repeats = [plan.batches[i % n] for i in range(s.padded_batches)] if n else []
        delivered = plan.batches[: n - s.dropped_batches] + repeats
        acc = self._account(plan.order, delivered)
        padded = plan.pad_in_last + sum(len(batch_ids(b)) for b in repeats)
        return EpochReport(
            e,
            self.manifest.num_samples,
            s.steps_per_rank,
            padded,
            len(acc.dropped),
            len(acc.truncated),
            acc.tokens,
            acc.truncated_tokens,
            acc.dropped_tokens,
            acc.repeated_tokens,
            acc.padded_tokens,
        )

    def _account(self, order: np.ndarray, batches: list[np.ndarray]) -> PlanReport:
        lengths = self._lengths if self._lengths is not None else self._lengths_for_report()
        report = getattr(self.planner, "report", None)
        if report is not None and not isinstance(self.planner, FixedBatches):
            return report(order, lengths, batches)  # type: ignore[no-any-return]
        return account_fixed(order, lengths, batches, self.collate_fn)  # the collate pads

    def _lengths_for_report(self) -> np.ndarray | None:
        if self._report_lengths is None:
            lengths = None
            if self.manifest.length_field is not None:
                lengths = self._load_lengths(required=False)
            self._report_lengths = (lengths,)
        return self._report_lengths[0]

    def __len__(self) -> int:
        """Steps (batches, or samples when unbatched) this rank yields in the current epoch."""
        key = tuple(self._control.get())  # epoch, start, rank, world
        cached = self._len_cache
        if cached is None or cached[0] != key:
            steps = self._plan(*key).slots.steps_per_rank
            self._len_cache = cached = (key, steps)
        return cached[1]

    # -- planning (pure) ------------------------------------------------------------------
    def _load_lengths(self, required: bool = True) -> np.ndarray | None:
        parts = []
        for info in self.manifest.shards:
            data = read_bytes(
                join(self.base, info.index_path),
                self.read_options.storage_options,
                policy=self.read_options.retry,
            )
            idx = SampleIndex.from_arrow_bytes(data, info.index_path)
            if idx.lengths is None:
                if not required:
                    return None
                raise UsageError(
                    f"the planner needs per-sample lengths but {info.index_path} has none; "
                    "pack with a text/token field (manifest length_field) to record them"
                )
            parts.append(idx.lengths)
        return np.concatenate(parts).astype(np.int64)

    def _plan(self, epoch: int, start: int, rank: int, world: int) -> _Plan:
        order = epoch_order(self.manifest.shard_sizes, self.seed, epoch, self.shuffle)
        pad_in_last = dropped = 0
        if self.planner is not None:
            batches = list(self.planner.plan(order, self._lengths, plan_rng(self.seed, epoch)))
        else:
            batches, pad_in_last, dropped = cut_fixed_batches(
                order, self.batch_size or 1, self.uneven
            )
        slots = rank_slots(len(batches), start, rank, world, self.uneven)
        return _Plan(order, batches, slots, pad_in_last, dropped, len(batches), start)

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        epoch, start, rank, world = self._control.get()
        place = detect_place(rank, world)
        seed_global_rngs(derive_seed(self.seed, epoch, place.rank, place.worker, 1 << 40))
        plan = self._plan(epoch, start, place.rank, place.world_size)
        mine = slice(place.worker, None, place.num_workers)
        slots, seeds = plan.slots.slots[mine], plan.slots.seeds[mine]
        reads = [batch_ids(b) for b in plan.batches]  # the samples each batch reads
        need = working_set_bytes(self.manifest, self.shuffle, reads, self.read_options.readahead)
        shards = ShardSet(self.manifest, self.base, self.read_options, str(place), need)
        try:
            batch_shards = [shards.locate(reads[int(s)])[0] for s in slots]
            upcoming = _first_needed(batch_shards)
            ahead = 0
            for j, (slot, seed_index) in enumerate(zip(slots, seeds, strict=False)):
                ahead = _advance_readahead(shards, upcoming, j, ahead)
                batch, ids = plan.batches[int(slot)], reads[int(slot)]
                seed_global_rngs(derive_seed(self.seed, epoch, int(seed_index)))
                pads = _pad_mask(plan, int(slot), int(seed_index), len(ids))
                samples, substituted = self._load_batch(shards, ids, pads, place)
                if batch.ndim == 2:
                    samples = self._cut_segments(batch, ids, samples, substituted, place)
                if self.batch_size is None and self.planner is None:
                    if samples:
                        yield samples[0]
                elif self.collate_fn is not None:
                    yield self.collate_fn(samples)
                else:
                    from torch.utils.data import default_collate

                    yield default_collate(samples)
        finally:
            shards.close()

    def _load_batch(
        self, shards: ShardSet, ids: np.ndarray, pads: np.ndarray, place: Place
    ) -> tuple[list[dict[str, Any]], np.ndarray]:
        """Read, decode and transform one batch's samples, in planned order; also say which
        samples stand in for bad ones.

        Under ``on_error="skip"`` a bad sample is replaced by a repeat of a good one from the
        same batch, flagged ``__pad__``, so batch shapes and step counts never change.
        """
        shard_of, local_of = shards.locate(ids)
        out: list[dict[str, Any] | None] = []
        last_error: ShardloaderError | None = None
        for gid, shard, local, pad in zip(ids, shard_of, local_of, pads, strict=False):
            try:
                out.append(self._load_sample(shards, int(shard), int(local), int(gid), bool(pad)))
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

    def _cut_segments(
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
        field = self.manifest.length_field
        assert field is not None and self._lengths is not None  # checked by resolve_collate
        tokens_of: dict[int, tuple[dict[str, Any], Any]] = {}
        for gid, sample, stand_in in zip(ids.tolist(), samples, substituted.tolist(), strict=True):
            tokens = sample.get(field)
            if tokens is None:
                raise UsageError(
                    f"sample {sample.get('__key__')!r} ({place}) has no field {field!r} to cut "
                    f"into the planned segments (fields: {', '.join(map(str, sample))})"
                )
            planned = int(self._lengths[gid])
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

    def _load_sample(
        self, shards: ShardSet, shard: int, local: int, gid: int, pad: bool
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
                sample[name] = self._decode(name, ext, data)
            except DecodeError as err:
                raise DecodeError(f"{_where(shards, shard, key)}: {err}") from err
        if self.transform is None:
            return sample
        try:
            out = self.transform(sample)
        except Exception as err:  # user code: anything at all
            raise _located(err, _where(shards, shard, key)) from err
        if not isinstance(out, Mapping):
            raise UsageError(
                f"{_where(shards, shard, key)}: transform returned {type(out).__name__}; it "
                "must return the sample dict (filtering in a transform would make ranks uneven)"
            )
        return dict(out)

    def _decode(self, name: str, ext: str, data: bytes) -> Any:
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


def _signature(planner: Any, batch_size: int | None, shuffle: ShuffleOptions, uneven: str) -> str:
    plan = signature_of(planner) if planner is not None else f"fixed({stable_value(batch_size)})"
    return f"{plan};shuffle={signature_of(shuffle)};uneven={uneven}"


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


def _pad_mask(plan: _Plan, slot: int, seed_index: int, n: int) -> np.ndarray:
    mask = np.zeros(n, bool)
    if seed_index >= plan.num_batches:  # a repeated batch that evens out the ranks
        mask[:] = True
    elif slot == plan.num_batches - 1 and plan.pad_in_last:
        mask[n - plan.pad_in_last :] = True
    return mask


def _first_needed(batch_shards: list[np.ndarray]) -> list[tuple[int, int]]:
    """(step, shard) for each shard in the order this worker first needs it."""
    seen: set[int] = set()
    out = []
    for j, shards in enumerate(batch_shards):
        for s in dict.fromkeys(int(x) for x in shards):
            if s not in seen:
                seen.add(s)
                out.append((j, s))
    return out


def _advance_readahead(
    shards: ShardSet,
    upcoming: list[tuple[int, int]],
    step: int,
    ahead: int,
) -> int:
    """Stage the shards this step needs, and ``readahead`` more, in the background pool.

    Shards the current step needs are submitted too, so a batch spread over several shards
    downloads them in parallel instead of one after another.
    """
    limit = shards.options.readahead
    if shards.in_place or limit <= 0:
        return ahead
    due = ahead
    while due < len(upcoming) and upcoming[due][0] <= step:
        due += 1
    target = min(len(upcoming), due + limit)
    if target > ahead:
        shards.prefetch(s for _, s in upcoming[ahead:target])
        return target
    return ahead
