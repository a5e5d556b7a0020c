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
the dataset's epoch and position, NOTE [why shared memory here] in deliver/position.py), so
persistent DataLoader workers see a change; ``state_dict()`` records it and a resume replays it.

Stages (weights changing at optimizer steps): NOTE [stages] in :mod:`shardloader.plan.stages`.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardloader.batching.base import check_planner
from shardloader.dataset import Packed, ShardedDataset
from shardloader.deliver.position import Control, integer
from shardloader.errors import UsageError
from shardloader.manifest import Manifest, read_manifest
from shardloader.options import ReadOptions, ShuffleOptions
from shardloader.plan.blend import MixOrder, schedule_parts
from shardloader.plan.epoch import EpochReport
from shardloader.plan.mixcounts import delivered_by_source
from shardloader.plan.mixschedule import Entries, read_entries, saved_entries, write_entries
from shardloader.plan.rowmix import epoch_tokens, row_tokens, source_rows
from shardloader.plan.shuffle import derive_seed
from shardloader.plan.stages import check_stages, saved_step_size, stage_counts, stage_positions
from shardloader.plan.tokenblend import TokenMixOrder
from shardloader.read.lengths import load_lengths
from shardloader.read.mixed import MixedShards, virtual_manifest
from shardloader.read.shardset import ShardSet

__all__ = ["Blend", "Source", "Mixture", "MixtureReport", "SourceCounts", "MixedShards"]

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


class Blend(Packed):
    """The sources of a mixture as what a dataset reads: one manifest over every source's
    shards (:func:`virtual_manifest`), lengths and shards mapped back to each source, and the
    blended epoch order under the weight schedule (NOTE [mixture state]) or the stages."""

    def __init__(
        self,
        sources: Mapping[str, str | Source],
        weights: Mapping[str, float] | None,
        stages: Sequence[tuple[int, Mapping[str, float]]] | None,
        epoch_samples: int | None,
        by: str,
        shuffle: bool | ShuffleOptions,
        seed: int,
        read: ReadOptions,
        options: Mapping[str, Any],
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise UsageError("a Mixture needs sources: {name: url or Source}, at least one")
        if by not in BLEND_UNITS:
            raise UsageError(f"by={by!r} is not one of {BLEND_UNITS}")
        seed = integer("seed", seed)
        planner = check_planner(options.get("planner"))
        self.rows = planner is not None and planner.units == "rows"  # NOTE [token rows mix]
        if self.rows and (by != "samples" or stages is not None):
            raise UsageError(
                f"{type(planner).__name__} mixes rows of seq_len tokens, already exact in "
                "tokens: leave by= at its default; stages= need batch_size= (use weights=)"
            )
        self.names = tuple(str(n) for n in sources)
        self.by, self.read, self.url = by, read, "mixture:" + ",".join(self.names)
        self.by_tokens: tuple[tuple[np.ndarray, ...], int] | None = None
        self.opened: list[tuple[Manifest, str, ReadOptions]] = []
        shuffles, seeds = [], []
        for name, given in sources.items():
            src = Source(given) if isinstance(given, str) else given
            if not isinstance(src, Source):
                raise UsageError(f"source {name!r}: expected a URL or a Source, got {given!r}")
            own_read = src.read or read
            manifest, base = read_manifest(own_read.store(src.url))
            if manifest.num_samples == 0:
                raise UsageError(f"source {name!r} ({src.url}) holds no samples")
            self.opened.append((manifest, base, own_read))
            own = shuffle if src.shuffle is None else src.shuffle
            shuffles.append(own if isinstance(own, ShuffleOptions) else ShuffleOptions(own))
            tag = zlib.crc32(str(name).encode())
            seeds.append(derive_seed(seed, _MIX_SEED, tag) if src.seed is None else int(src.seed))
        self.manifest = virtual_manifest(self.names, [m for m, _, _ in self.opened])
        sizes = tuple(tuple(int(x) for x in m.shard_sizes) for m, _, _ in self.opened)
        self.source_lengths: list[np.ndarray] | None = None
        if self.rows:  # positions are rows (NOTE [token rows mix] in plan/rowmix.py)
            sizes, self.source_lengths = source_rows(planner, self.names, self.opened, load_lengths)
        total = sum(sum(s) for s in sizes)
        self.epoch_samples = (
            total if epoch_samples is None else integer("epoch_samples", epoch_samples)
        )
        if self.epoch_samples < 1:
            raise UsageError(f"epoch_samples must be >= 1, got {epoch_samples!r}")
        self.static = (sizes, tuple(seeds), tuple(shuffles))
        self.stage_steps = check_stages(  # NOTE [stages] in plan/stages.py
            weights, stages, planner, options.get("batch_size"), _MAX_ENTRIES, self.parts_of
        )
        staged = self.stage_steps[0][1] if self.stage_steps else None
        parts = staged or self.parts_of(weights or {}, "weights")
        self.step_size = Control([0])  # NOTE [stages]: fixed by the first state saved
        capacity = 1 + _MAX_ENTRIES * (1 + len(self.names))
        self.schedule = Control([1, 0, *parts] + [0] * (capacity - 2 - len(parts)))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["by_tokens"] = state["source_lengths"] = None  # loaded where needed
        return state

    def lengths(self, required: bool) -> np.ndarray | None:
        parts: list[np.ndarray] = []
        for name, (m, base, read) in zip(self.names, self.opened, strict=True):
            if m.length_field is None or m.length_field != self.manifest.length_field:
                if not required:
                    return None
                raise UsageError(
                    f"the planner needs per-sample lengths but source {name!r} records "
                    f"{m.length_field!r} and the mixture {self.manifest.length_field!r}; pack "
                    "every source with the same text/token field"
                )
            own = self.source_lengths
            got = own[len(parts)] if own else load_lengths(m, base, read, required=required)
            if got is None:
                return None
            parts.append(got)
        return np.concatenate(parts)

    def shard_set(self, where: str, working_set: int) -> Any:
        sets = [  # every error then names the source too: "(source 'web', rank 0/2, ...)"
            ShardSet(m, base, read, f"source {name!r}, {where}", working_set)
            for name, (m, base, read) in zip(self.names, self.opened, strict=True)
        ]
        return MixedShards(sets, self.read)

    def order(self, mix: Mixture) -> MixOrder:  # NOTE [mixture partitions] in plan/blend.py
        sizes, seeds, shuffles = self.static
        stages: tuple[tuple[int, tuple[int, ...]], ...] = ()
        named = ""
        if self.stage_steps:  # NOTE [stages]
            starts = [pos for _, pos in mix.stage_starts()]
            stages = tuple(zip(starts, [p for _, p in self.stage_steps], strict=True))
            named = str([[st, list(p)] for st, p in self.stage_steps]).replace(" ", "")
        args = (sizes, seeds, shuffles, self.epoch_samples, self.entries(), stages, named)
        if self.by == "tokens":  # NOTE [token deadlines] in plan/tokenblend.py
            lengths, key = self.token_lengths()
            return TokenMixOrder(*args, lengths=lengths, lengths_key=key)
        return MixOrder(*args)

    def parts_of(self, weights: Mapping[str, float], where: str) -> tuple[int, ...]:
        if not isinstance(weights, Mapping):
            raise UsageError(f"{where} must be a mapping {{source name: weight}}, got {weights!r}")
        if self.by == "tokens":
            self.token_lengths()  # checked now: every source must record lengths
        return schedule_parts(self.names, weights, where)  # by="tokens": token parts

    def token_lengths(self) -> tuple[tuple[np.ndarray, ...], int]:
        """Per source its documents' recorded lengths, and a checksum of them all (what
        :class:`~shardloader.plan.tokenblend.TokenMixOrder` places by); loaded once."""
        if self.by_tokens is not None:
            return self.by_tokens
        found = []
        for name, (m, base, read) in zip(self.names, self.opened, strict=True):
            lengths = load_lengths(m, base, read, required=False) if m.length_field else None
            if lengths is None or not lengths.sum():
                raise UsageError(
                    f"by='tokens' needs token counts, but source {name!r} records no lengths "
                    "(pack it with a text or token field)"
                )
            found.append(np.asarray(lengths, np.int64))
        key = zlib.crc32(b"".join(a.tobytes() for a in found))
        self.by_tokens = (tuple(found), key)
        return self.by_tokens

    def entries(self) -> Entries:
        return read_entries(self.schedule.get(), len(self.names))

    def set_parts(self, parts: tuple[int, ...], epoch: int) -> None:
        """Blend with ``parts`` from ``epoch`` on (a plan is cached by its order: no reset)."""
        kept = [(e, p) for e, p in self.entries() if e < epoch]
        if not kept or kept[-1][1] != parts:
            kept.append((epoch, parts))
        write_entries(self.schedule, len(self.names), kept, _MAX_ENTRIES)

    def normalised(self, parts: tuple[int, ...]) -> dict[str, float]:
        total = sum(parts)
        return {n: p / total for n, p in zip(self.names, parts, strict=True)}

    def extra_state(self, mix: Mixture) -> dict[str, Any]:
        """What the loader state adds (NOTE [mixture state]): sources and weight schedule."""
        saved: dict[str, Any] = {
            "sources": list(self.names),
            "by": self.by,
            "schedule": [[e, list(p)] for e, p in self.entries()],
        }
        if self.stage_steps:  # NOTE [stages]: where they begin, in this run's steps
            saved["stages"] = [[st, list(p)] for st, p in self.stage_steps]
            saved["samples_per_step"] = mix.samples_per_step
        return {"mixture": saved}

    def load_extra_state(
        self, mix: Mixture, state: Mapping[str, Any], epoch: int, position: int
    ) -> None:
        """Replay a saved schedule; weights passed to this Mixture that differ from the ones
        saved for the resumed epoch apply from the next epoch not yet begun.  Saved stages
        stay at the stream positions the saved run put them (NOTE [stages]); they must be
        this mixture's."""
        saved: Any = state.get("mixture")
        entries = saved_entries(saved, self.names)
        if self.stage_steps or "stages" in saved:
            self.step_size.update({0: saved_step_size(saved, self.stage_steps)})
            return
        mine = self.entries()[-1][1]  # the weights this Mixture was made with
        write_entries(self.schedule, len(self.names), entries, _MAX_ENTRIES)
        boundary = epoch if position == 0 else epoch + 1
        if self.order(mix).parts_at(boundary) != mine:
            self.set_parts(mine, boundary)


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
    ``planner=TokenBlocks(...)`` over token sources blends rows of ``seq_len`` tokens (positions
    are rows): every prefix within one row of each share (NOTE [token rows mix], plan/rowmix.py).

    Every other argument is :class:`ShardedDataset`'s (batch size or planner, shuffle, seed,
    uneven, transform, collate, decoder, on_error, read, world), applied to the mixed
    stream; ``shuffle`` and ``read`` are also the sources' defaults.  The mixture reads its
    sources through a :class:`Blend`.
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
        read = read or ReadOptions()
        blend = Blend(sources, weights, stages, epoch_samples, by, shuffle, seed, read, options)
        self.blend = blend
        self.names, self.by, self.epoch_samples = blend.names, by, blend.epoch_samples
        super().__init__(blend, shuffle=shuffle, seed=seed, read=read, **options)

    @property
    def samples_per_step(self) -> int:
        """Samples of one optimizer step that stages are counted in: ``batch_size`` x world
        size, kept from the first run by its saved state (NOTE [stages])."""
        return self.blend.step_size.get()[0] or int(self.batch_size or 1) * self.world_size

    def stage_starts(self) -> list[tuple[int, int]]:
        """``(step, stream position)`` where each stage begins (NOTE [stages])."""
        per_step, steps = self.samples_per_step, self.blend.stage_steps
        nodes = self.partition.nodes
        return stage_positions(steps, per_step, self.epoch_samples, self.uneven, nodes)

    def stage_report(self, epochs: int) -> list[dict[str, Any]]:
        """Each stage's first step and stream position, and what it delivers per source in
        the first ``epochs`` mixture epochs (documents, and tokens where lengths are recorded;
        the last stage up to that end): what ``shardloader plan --stage`` prints."""
        blend = self.blend
        sizes = {n: m.num_samples for n, (m, _, _) in zip(self.names, blend.opened, strict=True)}
        weights = [blend.normalised(p) for _, p in blend.stage_steps]
        order, lengths = blend.order(self).order, self._lengths_for_report
        return stage_counts(
            self.stage_starts(), weights, order, self.epoch_samples, epochs, sizes, lengths
        )

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The blended order of mixture epoch ``epoch`` (default: current), as virtual ids
        (source ``s``'s sample ``i`` is ``offsets[s] + i``); pure, reads no shard."""
        e = self.epoch if epoch is None else epoch  # in this world's partitions
        return self.blend.order(self).partitioned(e, self.partition.nodes)[0]

    @property
    def offsets(self) -> dict[str, int]:
        """Each source's first virtual id."""
        sizes = [sum(s) for s in self.blend.static[0]]  # rows with TokenBlocks
        return dict(zip(self.names, np.cumsum([0, *sizes[:-1]]).tolist(), strict=True))

    # -- weights and their schedule ---------------------------------------------------------
    def set_weights(self, weights: Mapping[str, float], *, epoch: int) -> None:
        """Blend with ``weights`` from mixture epoch ``epoch`` on; epochs before keep theirs
        and later changes already scheduled are replaced.  ``epoch`` is explicit: after a pass
        the dataset cannot tell a finished epoch from one not begun, and an epoch's batches
        must keep the weights they were planned with (NOTE [mixture state]).  Call it between
        passes (never during one)."""
        epoch = integer("epoch", epoch)
        if self.blend.stage_steps:
            raise UsageError("this mixture's weights follow its stages: build it with new stages")
        if epoch < 0:
            raise UsageError(f"epoch must be >= 0, got {epoch}")
        self.blend.set_parts(self.blend.parts_of(weights, "weights"), epoch)

    @property
    def schedule(self) -> list[tuple[int, dict[str, float]]]:
        """``(from_epoch, {name: weight})`` of every weight change, weights normalised
        (the stages of a staged mixture are :attr:`stages`)."""
        return [(e, self.blend.normalised(p)) for e, p in self.blend.entries()]

    @property
    def stages(self) -> list[tuple[int, dict[str, float]]]:
        """``(from_step, {name: weight})`` of each stage, weights normalised (empty: none)."""
        return [(st, self.blend.normalised(p)) for st, p in self.blend.stage_steps]

    def weights(self, epoch: int | None = None) -> dict[str, float]:
        """The (normalised) weights in force for mixture epoch ``epoch`` (default: current)."""
        parts = self.blend.order(self).parts_at(self.epoch if epoch is None else epoch)
        return self.blend.normalised(parts)

    def report(self, epoch: int | None = None) -> MixtureReport:
        """:meth:`ShardedDataset.report` of the mixed stream plus per source counts."""
        base, blend = super().report(epoch), self.blend
        e = base.epoch
        plans = self._planning.cluster(e, 0, self.partition, self._lengths)
        counted = self._lengths_for_report
        sizes = [sum(s) for s in blend.static[0]]
        if blend.rows and counted is not None:  # rows and their tokens (plan/rowmix.py)
            counted = row_tokens(self.planner, blend.manifest.shard_sizes, counted)
        samples, tokens, flat = delivered_by_source(plans, sizes, counted)
        order = blend.order(self)
        planned = np.bincount(order.sources(e), minlength=len(blend.names))
        own_epoch, started = order.source_epochs(e)
        weights = blend.normalised(order.parts_at(e))
        counts = {
            name: SourceCounts(
                weights[name],
                int(planned[s]),
                int(samples[s]),
                None if counted is None and not flat else int(tokens[s]),
                int(own_epoch[s]),
                int(started[s]),
            )
            for s, name in enumerate(blend.names)
        }
        values = {f.name: getattr(base, f.name) for f in dataclasses.fields(EpochReport)}
        values["num_samples"] = blend.epoch_samples
        if blend.rows and self._lengths is not None:  # NOTE [token rows mix]
            shards, lens = blend.manifest.shard_sizes, self._lengths
            values |= epoch_tokens(self.planner, shards, lens, plans, order.order(e))
        return MixtureReport(**values, sources=counts)
