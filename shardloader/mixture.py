"""``Mixture``: several packed datasets blended by weight into one stream.

A mixture is a :class:`~shardloader.dataset.ShardedDataset` over a *virtual* id space: source
``s``'s sample ``i`` is id ``offset[s] + i`` (sources in the order given), its shards numbered
after the previous sources'.  The epoch order is the blend of :mod:`shardloader.plan.blend` (each
source's own seeded epochs, interleaved by the exact minimum-error rule) instead of one
dataset's shuffle; everything after the order (planners, the rank and worker split, padding,
resume, per-step seeds) is the dataset's, unchanged, so every guarantee of a single dataset
holds for the mixed stream.  Reading maps an id back to its source's
:class:`~shardloader.read.shardset.ShardSet` (:class:`~shardloader.read.mixed.MixedShards`).

NOTE [mixture state]: the weights may change at a resume.  The plan of a mixture epoch is
fixed by the weights in force for it, and the batches of a partly read epoch were planned with
those, so a new weight applies from the next mixture epoch (or from the resumed one when it
has not begun).  The schedule of ``(from_epoch, integer parts)`` lives in shared memory (like
the dataset's epoch and position, NOTE [why shared memory here] in deliver/control.py), so
persistent DataLoader workers see a change; ``state_dict()`` records it and a resume replays it.

NOTE [stages]: ``stages=[(step, weights), ...]`` change the weights at global optimizer steps,
mid-epoch too.  A step of fixed batches holds ``batch_size x world size`` positions of the
mixed stream (steps counted across mixture epochs as the loader counts them), so each stage
begins at a fixed stream position and the blend (:class:`~shardloader.plan.blend.MixOrder`)
starts a fresh segment there.  The first saved state fixes that step size: a resume on another
world size or worker count keeps every stage at the same stream position, so the continuation
equals an unbroken run (and begins each stage at the same step when the global batch is kept,
as an elastic resume does).  The stages are in the plan signature and the state; a resume with
other stages is refused.  With ``by="tokens"`` each stage is a fresh token-deadline walk from
its position (:class:`~shardloader.plan.tokenblend.TokenMixOrder`).  Planners whose step holds
a number of samples known only after planning (packing, buckets, token budgets) are refused.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardloader.batching.base import check_planner
from shardloader.dataset import ShardedDataset
from shardloader.deliver.control import Control
from shardloader.deliver.position import integer
from shardloader.errors import ResumeError, UsageError
from shardloader.manifest import Manifest, read_manifest
from shardloader.options import ReadOptions, ShuffleOptions
from shardloader.plan.blend import MixOrder, schedule_parts
from shardloader.plan.epoch import EpochReport
from shardloader.plan.shuffle import derive_seed
from shardloader.plan.tokenblend import TokenMixOrder
from shardloader.read.lengths import load_lengths
from shardloader.read.mixed import MixedShards, virtual_manifest
from shardloader.read.shardset import ShardSet

__all__ = ["Source", "Mixture", "MixtureReport", "SourceCounts", "MixedShards"]

_MIX_SEED = 0x6D6978  # domain tag of the sources' own seeds ("mix")
_MAX_ENTRIES = 64  # weight changes a schedule holds
BLEND_UNITS = ("samples", "tokens")


@dataclass(frozen=True)
class Source:
    """One source of a mixture: a packed dataset URL and its own options.

    ``read``: how its shards are fetched (storage options, cache, retries; default the
    mixture's).  ``shuffle``: its own epochs' shuffle (default the mixture's).  ``seed``: the
    seed of its own epochs (default derived from the mixture's seed and the source's name, so
    sources never share an order).
    """

    url: str
    read: ReadOptions | None = None
    shuffle: bool | ShuffleOptions | None = None
    seed: int | None = None


@dataclass(frozen=True)
class SourceCounts:
    """One source's share of a mixture epoch (all ranks together).

    ``samples``: its positions delivered (a sample twice if two of its own epochs fall in
    this mixture epoch; padding repeats not counted); ``tokens``: their tokens delivered (None
    without a length field); ``planned``: positions of the blend (before a planner's tail
    rules, e.g. ``uneven="drop"``);
    ``epoch``: the source's own epoch at the mixture epoch's end; ``epochs_started``: how many
    of its own epochs have begun by then; ``weight``: its weight in force (normalised).
    """

    weight: float
    planned: int
    samples: int
    tokens: int | None
    epoch: int
    epochs_started: int


@dataclass(frozen=True)
class MixtureReport(EpochReport):
    """:class:`~shardloader.plan.epoch.EpochReport` of the mixed stream, plus per source counts."""

    sources: Mapping[str, SourceCounts] = field(default_factory=dict)


class Mixture(ShardedDataset):
    """Blend named sources by weight into one stream (``shardloader.Mixture``).

    ``sources``: ``{name: url or Source}``; ``weights``: ``{name: weight}`` (any positive
    scale: ``0.7, 0.3`` or ``7, 3``).  After any prefix of a mixture epoch each source has had
    its weight's share of the samples within one sample (``by="samples"``, exact: NOTE [the
    blend] in :mod:`shardloader.plan.blend`).  ``by="tokens"`` means the weights in tokens and
    places each document by token deadline from the recorded lengths: after any prefix each
    source's tokens are within one of its longest documents of its share (NOTE [token
    deadlines] in :mod:`shardloader.plan.tokenblend`).
    Each source keeps its own epochs, each a fresh seeded permutation in which every sample
    comes exactly once.  ``epoch_samples``: positions of a mixture epoch (default: all
    sources' samples together), the unit of ``set_epoch``, resume and weight changes.

    Every other argument is :class:`ShardedDataset`'s (batch size or planner, shuffle, seed,
    uneven, transform, collate, decoder, on_error, read, world), applied to the mixed
    stream; ``shuffle`` and ``read`` are also the sources' defaults.
    """

    def __init__(
        self,
        sources: Mapping[str, str | Source],
        weights: Mapping[str, float] | None = None,
        *,
        stages: Sequence[tuple[int, Mapping[str, float]]] | None = None,
        epoch_samples: int | None = None,
        by: str = "samples",
        shuffle: bool | ShuffleOptions = False,
        seed: int = 0,
        read: ReadOptions | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise UsageError("a Mixture needs sources: {name: url or Source}, at least one")
        if by not in BLEND_UNITS:
            raise UsageError(f"by={by!r} is not one of {BLEND_UNITS}")
        planner = check_planner(options.get("planner"))
        if planner is not None and planner.units == "rows":
            raise UsageError(
                f"{type(planner).__name__} plans rows of one token stream and cannot blend "
                "sources; pack rows from a mixture with PackedBatches"
            )
        read = read or ReadOptions()
        base_shuffle = shuffle if isinstance(shuffle, ShuffleOptions) else ShuffleOptions(shuffle)
        seed = integer("seed", seed)
        self.names = tuple(str(n) for n in sources)
        self.by = by
        self._by_tokens: tuple[tuple[np.ndarray, ...], int] | None = None
        opened: list[tuple[Manifest, str, ReadOptions]] = []
        shuffles, seeds = [], []
        for name, given in sources.items():
            src = Source(given) if isinstance(given, str) else given
            if not isinstance(src, Source):
                raise UsageError(f"source {name!r}: expected a URL or a Source, got {given!r}")
            own_read = src.read or read
            manifest, base = read_manifest(own_read.store(src.url))
            if manifest.num_samples == 0:
                raise UsageError(f"source {name!r} ({src.url}) holds no samples")
            opened.append((manifest, base, own_read))
            own = base_shuffle if src.shuffle is None else src.shuffle
            shuffles.append(own if isinstance(own, ShuffleOptions) else ShuffleOptions(own))
            tag = zlib.crc32(str(name).encode())
            seeds.append(derive_seed(seed, _MIX_SEED, tag) if src.seed is None else int(src.seed))
        self._opened = opened
        total = sum(m.num_samples for m, _, _ in opened)
        self.epoch_samples = (
            total if epoch_samples is None else integer("epoch_samples", epoch_samples)
        )
        if self.epoch_samples < 1:
            raise UsageError(f"epoch_samples must be >= 1, got {epoch_samples!r}")
        self._static = (
            tuple(tuple(int(x) for x in m.shard_sizes) for m, _, _ in opened),
            tuple(seeds),
            tuple(shuffles),
        )
        self._stage_steps = self._check_stages(weights, stages, planner, options)
        parts = (
            self._stage_steps[0][1]
            if self._stage_steps
            else self._parts_of(weights or {}, "weights")
        )
        self._samples_per_step = Control([0])  # NOTE [stages]: fixed by the first state saved
        capacity = 1 + _MAX_ENTRIES * (1 + len(self.names))
        self._schedule = Control([1, 0, *parts] + [0] * (capacity - 2 - len(parts)))
        super().__init__(
            "mixture:" + ",".join(self.names),
            shuffle=base_shuffle,
            seed=seed,
            read=read,
            **options,
        )

    def _check_stages(
        self,
        weights: Mapping[str, float] | None,
        stages: Sequence[tuple[int, Mapping[str, float]]] | None,
        planner: Any,
        options: Mapping[str, Any],
    ) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """``stages`` as ``(step, integer parts)``, checked (NOTE [stages])."""
        if stages is None:
            if weights is None:
                raise UsageError("a Mixture needs weights={name: weight} or stages=[(step, ...)]")
            return ()
        if weights is not None:
            raise UsageError("pass weights= or stages=, not both: stages carry the weights")
        if planner is not None or not options.get("batch_size"):
            what = "no batch_size" if planner is None else type(planner).__name__
            raise UsageError(
                f"stages change weights at optimizer steps, which need fixed batches "
                f"(batch_size=N); with {what} the samples of a step are known only after "
                "planning: use batch_size=, or weights= with set_weights at mixture epochs"
            )
        try:
            steps = [(integer("stage step", st), w) for st, w in stages]
        except (TypeError, ValueError) as err:
            raise UsageError(
                f"stages must be [(step, {{name: weight}}), ...], got {stages!r}"
            ) from err
        if not steps or steps[0][0] != 0:
            raise UsageError(f"the first stage must begin at step 0, got {stages!r}")
        if any(a[0] >= b[0] for a, b in zip(steps, steps[1:], strict=False)):
            raise UsageError(f"stage steps must increase, got {[st for st, _ in steps]}")
        if len(steps) > _MAX_ENTRIES:
            raise UsageError(f"a mixture holds at most {_MAX_ENTRIES} stages, got {len(steps)}")
        return tuple((st, self._parts_of(w, f"stage at step {st}")) for st, w in steps)

    @property
    def samples_per_step(self) -> int:
        """Samples of one optimizer step that stages are counted in: ``batch_size`` x world
        size, kept from the first run by its saved state (NOTE [stages])."""
        world = self.world_size if hasattr(self, "_control") else 1  # (during __init__)
        return self._samples_per_step.get()[0] or int(self.batch_size or 1) * world

    def stage_starts(self) -> list[tuple[int, int]]:
        """``(step, stream position)`` where each stage begins (NOTE [stages]): a step counts
        the steps of earlier mixture epochs as the loader does (the last one of an epoch
        padded, or dropped with ``uneven="drop"``)."""
        if hasattr(self, "_control") and self.partition.nodes > 1:
            raise UsageError(
                f"stages need one partition of the mixed stream, but this world reads "
                f"{self.partition.nodes} node partitions, whose steps do not follow the stream "
                "position by position: pass world=shardloader.World(partition='global') (every "
                "node reads every source's shards), or weights= with set_weights at epochs"
            )
        per_step, e = self.samples_per_step, self.epoch_samples
        per_epoch = e // per_step if self.uneven == "drop" else -(-e // per_step)
        out = []
        for step, _ in self._stage_steps:
            epoch, rest = divmod(step, max(per_epoch, 1))
            out.append((step, epoch * e + min(rest * per_step, e)))
        return out

    def stage_report(self, epochs: int) -> list[dict[str, Any]]:
        """Each stage's first step and stream position, and what it delivers per source in
        the first ``epochs`` mixture epochs (documents, and tokens where lengths are recorded;
        the last stage up to that end): what ``shardloader plan --stage`` prints."""
        mix, horizon = self._order_source(), epochs * self.epoch_samples
        lengths = self._lengths_for_report()
        sizes = [m.num_samples for m, _, _ in self._opened]
        bounds = np.cumsum([0, *sizes])
        starts = self.stage_starts() + [(None, horizon)]
        out = []
        for (step, lo), (_, hi), (_, parts) in zip(
            starts, starts[1:], self._stage_steps, strict=False
        ):
            lo, hi = min(lo, horizon), min(hi, horizon)
            ids = [
                mix.order(e)[max(lo - e * self.epoch_samples, 0) : hi - e * self.epoch_samples]
                for e in range(lo // self.epoch_samples, -(-hi // self.epoch_samples))
            ]
            got = np.concatenate([np.zeros(0, np.int64), *ids]).astype(np.int64)
            src = np.searchsorted(bounds, got, side="right") - 1
            k = len(self.names)
            samples = np.bincount(src, minlength=k)
            tokens = None if lengths is None else np.bincount(src, lengths[got], k)
            out.append({
                "step": step,
                "epoch": lo // self.epoch_samples,
                "position": lo,
                "positions": hi - lo,
                "weights": self._normalised(parts),
                "sources": {
                    n: {
                        "samples": int(samples[s]),
                        "tokens": None if tokens is None else int(tokens[s]),
                    }
                    for s, n in enumerate(self.names)
                },
            })  # fmt: skip
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_by_tokens"] = None  # lengths are loaded again where needed (node cache)
        return state

    # -- the virtual dataset ----------------------------------------------------------------
    def _open(self, url: str) -> tuple[Any, str]:
        """One manifest over every source's shards (:func:`virtual_manifest`)."""
        return virtual_manifest(self.names, [m for m, _, _ in self._opened]), url

    def _load_lengths(self, required: bool) -> np.ndarray | None:
        parts = []
        for name, (m, base, read) in zip(self.names, self._opened, strict=True):
            if m.length_field is None or m.length_field != self.manifest.length_field:
                if not required:
                    return None
                raise UsageError(
                    f"the planner needs per-sample lengths but source {name!r} records "
                    f"{m.length_field!r} and the mixture {self.manifest.length_field!r}; pack "
                    "every source with the same text/token field"
                )
            got = load_lengths(m, base, read, required=required)
            if got is None:
                return None
            parts.append(got)
        return np.concatenate(parts)

    def _shard_set(self, where: str, working_set: int) -> Any:
        sets = [  # every error then names the source too: "(source 'web', rank 0/2, ...)"
            ShardSet(m, base, read, f"source {name!r}, {where}", working_set)
            for name, (m, base, read) in zip(self.names, self._opened, strict=True)
        ]
        return MixedShards(sets, self.names, self.read_options)

    def _order_source(self) -> MixOrder:  # NOTE [mixture partitions] in plan/blend.py
        sizes, seeds, shuffles = self._static
        stages: tuple[tuple[int, tuple[int, ...]], ...] = ()
        named = ""
        if self._stage_steps:  # NOTE [stages]
            starts = [pos for _, pos in self.stage_starts()]
            stages = tuple(zip(starts, [p for _, p in self._stage_steps], strict=True))
            named = str([[st, list(p)] for st, p in self._stage_steps]).replace(" ", "")
        if self.by == "tokens":  # NOTE [token deadlines] in plan/tokenblend.py
            lengths, key = self._token_lengths()
            return TokenMixOrder(
                sizes, seeds, shuffles, self.epoch_samples, self._entries(), stages, named,
                lengths=lengths, lengths_key=key,
            )  # fmt: skip
        return MixOrder(sizes, seeds, shuffles, self.epoch_samples, self._entries(), stages, named)

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The blended order of mixture epoch ``epoch`` (default: current), as virtual ids
        (source ``s``'s sample ``i`` is ``offsets[s] + i``); pure, reads no shard."""
        e = self.epoch if epoch is None else epoch  # in this world's partitions
        return self._order_source().partitioned(e, self.partition.nodes)[0]

    @property
    def offsets(self) -> dict[str, int]:
        """Each source's first virtual id."""
        sizes = [m.num_samples for m, _, _ in self._opened]
        return dict(zip(self.names, np.cumsum([0, *sizes[:-1]]).tolist(), strict=True))

    # -- weights and their schedule ---------------------------------------------------------
    def _parts_of(self, weights: Mapping[str, float], where: str) -> tuple[int, ...]:
        if not isinstance(weights, Mapping):
            raise UsageError(f"{where} must be a mapping {{source name: weight}}, got {weights!r}")
        if self.by == "tokens":
            self._token_lengths()  # checked now: every source must record lengths
        return schedule_parts(self.names, weights, where)  # by="tokens": token parts

    def _token_lengths(self) -> tuple[tuple[np.ndarray, ...], int]:
        """Per source its documents' recorded lengths, and a checksum of them all (what
        :class:`~shardloader.plan.tokenblend.TokenMixOrder` places by); loaded once."""
        if self._by_tokens is not None:
            return self._by_tokens
        found = []
        for name, (m, base, read) in zip(self.names, self._opened, strict=True):
            lengths = load_lengths(m, base, read, required=False) if m.length_field else None
            if lengths is None or not lengths.sum():
                raise UsageError(
                    f"by='tokens' needs token counts, but source {name!r} records no lengths "
                    "(pack it with a text or token field)"
                )
            found.append(np.asarray(lengths, np.int64))
        key = zlib.crc32(b"".join(a.tobytes() for a in found))
        self._by_tokens = (tuple(found), key)
        return self._by_tokens

    def _entries(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        values, k = self._schedule.get(), len(self.names)
        out = []
        for e in range(values[0]):
            at = 1 + e * (1 + k)
            out.append((values[at], tuple(values[at + 1 : at + 1 + k])))
        return tuple(out)

    def _store(self, entries: list[tuple[int, tuple[int, ...]]]) -> None:
        if len(entries) > _MAX_ENTRIES:
            raise UsageError(f"a mixture holds at most {_MAX_ENTRIES} weight changes")
        k = len(self.names)
        for e, (start, parts) in enumerate(entries):
            at = 1 + e * (1 + k)
            self._schedule.set(at, start)
            for s, p in enumerate(parts):
                self._schedule.set(at + 1 + s, p)
        self._schedule.set(0, len(entries))
        self._plan_cache, self._len_cache = None, None

    def _set_parts(self, parts: tuple[int, ...], epoch: int) -> None:
        kept = [(e, p) for e, p in self._entries() if e < epoch]
        if not kept or kept[-1][1] != parts:
            kept.append((epoch, parts))
        self._store(kept)

    def set_weights(self, weights: Mapping[str, float], *, epoch: int) -> None:
        """Blend with ``weights`` from mixture epoch ``epoch`` on; epochs before keep theirs
        and later changes already scheduled are replaced.  ``epoch`` is explicit: after a pass
        the dataset cannot tell a finished epoch from one not begun, and an epoch's batches
        must keep the weights they were planned with (NOTE [mixture state]).  Call it between
        passes (never during one)."""
        epoch = integer("epoch", epoch)
        if self._stage_steps:
            raise UsageError("this mixture's weights follow its stages: build it with new stages")
        if epoch < 0:
            raise UsageError(f"epoch must be >= 0, got {epoch}")
        self._set_parts(self._parts_of(weights, "weights"), epoch)

    @property
    def schedule(self) -> list[tuple[int, dict[str, float]]]:
        """``(from_epoch, {name: weight})`` of every weight change, weights normalised
        (the stages of a staged mixture are :attr:`stages`)."""
        return [(e, self._normalised(p)) for e, p in self._entries()]

    @property
    def stages(self) -> list[tuple[int, dict[str, float]]]:
        """``(from_step, {name: weight})`` of each stage, weights normalised (empty: none)."""
        return [(st, self._normalised(p)) for st, p in self._stage_steps]

    def weights(self, epoch: int | None = None) -> dict[str, float]:
        """The (normalised) weights in force for mixture epoch ``epoch`` (default: current)."""
        return self._normalised(
            self._order_source().parts_at(self.epoch if epoch is None else epoch)
        )

    def _normalised(self, parts: tuple[int, ...]) -> dict[str, float]:
        total = sum(parts)
        return {n: p / total for n, p in zip(self.names, parts, strict=True)}

    def extra_state(self) -> dict[str, Any]:
        """What the loader state adds (NOTE [mixture state]): sources and weight schedule."""
        saved: dict[str, Any] = {
            "sources": list(self.names),
            "by": self.by,
            "schedule": [[e, list(p)] for e, p in self._entries()],
        }
        if self._stage_steps:  # NOTE [stages]: where they begin, in this run's steps
            saved["stages"] = [[st, list(p)] for st, p in self._stage_steps]
            saved["samples_per_step"] = self.samples_per_step
        return {"mixture": saved}

    def load_extra_state(self, state: Mapping[str, Any], epoch: int, position: int) -> None:
        """Replay a saved schedule; weights passed to this Mixture that differ from the ones
        saved for the resumed epoch apply from the next epoch not yet begun."""
        saved = state.get("mixture")
        if not isinstance(saved, Mapping):
            raise ResumeError("the saved state has no 'mixture' entry: it is not a Mixture's")
        if list(saved.get("sources", ())) != list(self.names):
            raise ResumeError(
                f"saved mixture sources {saved.get('sources')!r} are not this mixture's "
                f"{list(self.names)}: pass the same sources, in the same order"
            )
        try:
            entries = [(int(e), tuple(int(x) for x in p)) for e, p in saved["schedule"]]
        except (KeyError, TypeError, ValueError) as err:
            raise ResumeError(
                f"saved mixture schedule {saved.get('schedule')!r} is malformed"
            ) from err
        if (
            not entries
            or entries[0][0] != 0
            or any(len(p) != len(self.names) or sum(p) <= 0 or min(p) < 0 for _, p in entries)
            or any(a[0] >= b[0] for a, b in zip(entries, entries[1:], strict=False))
        ):
            raise ResumeError(f"saved mixture schedule {saved.get('schedule')!r} is malformed")
        if self._stage_steps or "stages" in saved:
            self._load_stages(saved)
            return
        mine = self._entries()[-1][1]  # the weights this Mixture was made with
        self._store(entries)
        boundary = epoch if position == 0 else epoch + 1
        if self._order_source().parts_at(boundary) != mine:
            self._set_parts(mine, boundary)

    def _load_stages(self, saved: Mapping[str, Any]) -> None:
        """Keep the saved stages at the stream positions the saved run put them (NOTE
        [stages]); they must be this mixture's."""
        mine = [[st, list(p)] for st, p in self._stage_steps]
        if saved.get("stages") != mine:
            raise ResumeError(
                f"saved stages {saved.get('stages')!r} are not this mixture's {mine}: pass the "
                "same stages (a staged mixture cannot change weights at a resume)"
            )
        per_step = saved.get("samples_per_step")
        if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 1:
            raise ResumeError(f"saved samples_per_step {per_step!r} must be an integer >= 1")
        self._samples_per_step.set(0, per_step)
        self._plan_cache, self._len_cache = None, None

    # -- reporting --------------------------------------------------------------------------
    def report(self, epoch: int | None = None) -> MixtureReport:
        """:meth:`ShardedDataset.report` of the mixed stream plus per source counts."""
        base = super().report(epoch)
        e = base.epoch
        plans = self._planning.cluster(e, 0, self.partition, self._lengths)
        lengths = self._lengths if self._lengths is not None else self._lengths_for_report()
        kept, real = [], []
        for plan in plans:  # each position once: a last batch's filling-up is not counted
            mine = list(plan.batches[: plan.num_batches - plan.slots.dropped_batches])
            kept += mine
            if mine and mine[0].ndim == 1:
                ids = np.concatenate(mine).astype(np.int64)
                if plan.pad_in_last and len(mine) == plan.num_batches:
                    ids = ids[: len(ids) - plan.pad_in_last]
                real.append(ids)
        offsets = np.concatenate([[0], np.cumsum([m.num_samples for m, _, _ in self._opened])])
        k = len(self.names)
        tokens = np.zeros(k, np.int64)
        if kept and kept[0].ndim == 2:  # segments (id, start, stop): a document starts at 0
            seg = np.concatenate(kept)
            seg_src = np.searchsorted(offsets, seg[:, 0], side="right") - 1
            samples = np.bincount(seg_src[seg[:, 1] == 0], minlength=k)
            tokens += np.bincount(seg_src, seg[:, 2] - seg[:, 1], k).astype(np.int64)
        else:
            ids = np.concatenate(real or [np.zeros(0, np.int64)])
            src = np.searchsorted(offsets, ids, side="right") - 1
            samples = np.bincount(src, minlength=k)
            if lengths is not None:
                tokens += np.bincount(src, lengths[ids], k).astype(np.int64)
        flat = kept and kept[0].ndim == 2
        mix = self._order_source()
        planned = np.bincount(mix.sources(e), minlength=len(self.names))
        own_epoch, started = mix.source_epochs(e)
        weights = self._normalised(mix.parts_at(e))
        counts = {
            name: SourceCounts(
                weights[name],
                int(planned[s]),
                int(samples[s]),
                None if lengths is None and not flat else int(tokens[s]),
                int(own_epoch[s]),
                int(started[s]),
            )
            for s, name in enumerate(self.names)
        }
        values = {f.name: getattr(base, f.name) for f in dataclasses.fields(EpochReport)}
        values["num_samples"] = self.epoch_samples
        return MixtureReport(**values, sources=counts)
