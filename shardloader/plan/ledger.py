"""The exactly-once ledger: which samples of an epoch were padded, dropped, truncated or
skipped, and why.

NOTE [the ledger comes from the plan]
    Padding, dropping and truncation are decisions of the pure epoch plan (order, planner,
    ``uneven``, world size), so :func:`build` recomputes them from the plan, exactly as
    ``ds.report()`` counts them: every rank (and anyone holding the dataset's arguments) gets
    the same ledger without talking to the others, and nothing is logged by workers.  Only a
    sample that turns out bad while it is read (``on_error="skip"``) is known at run time: a
    :class:`~shardloader.read.skips.SkipLog` appends it, from whichever worker met it, to a
    small JSON-lines file of its rank, and :func:`~shardloader.read.skips.merge_skips` reads
    every rank's file back into one sorted list (:meth:`Ledger.with_skips` adds it to an
    epoch's ledger).

The ledger counts as ``report()`` does, per occurrence (NOTE [occurrences] in
:mod:`shardloader.batching.base`): ``padded_samples`` counts each repeat of a sample, so a
sample repeated twice has two ``padded`` entries, and a sample the order lists more than once
(a mixture draws a small source again) has a ``dropped`` or ``truncated`` entry for each of
its occurrences that was.  Delivered samples are every occurrence of the epoch that is
neither dropped nor skipped.

NOTE [the ledger of token rows]
    Rows of :class:`~shardloader.batching.blocks.TokenBlocks` are windows of a shard's token
    stream, so a document may be delivered in part.  The entries add up to ``ds.report()``'s
    token counts: a ``padded`` entry per (repeated row, document it holds) with the tokens of
    that document the repeat delivers again (their sum is ``repeated_tokens``; NOTE [flagged
    repeats] in :mod:`shardloader.batching.blockchunks`), and one ``dropped`` or ``truncated``
    entry per document of which nothing, or only a part, is delivered (as
    ``dropped_samples``/``truncated_samples``, with ``dropped_tokens`` and
    ``truncated_tokens``).  The reason names what cut it: the shard's last partial row
    (``remainder="drop"``), the epoch's partial last batch (``tail="drop"``) or a batch left
    out for equal steps (``uneven="drop"``).  A mixture epoch (NOTE [token rows mix] in
    :mod:`shardloader.plan.rowmix`) holds some of its sources' rows: a document counts only
    its tokens in those rows, the rest belongs to other mixture epochs.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.batching.base import batch_ids, segment_counts
from shardloader.errors import UsageError

if TYPE_CHECKING:
    from shardloader.plan.epoch import EpochPlan, EpochPlanner

__all__ = ["Ledger", "LedgerEntry", "SkipRecord", "build"]

PADDED, DROPPED, TRUNCATED, SKIPPED = "padded", "dropped", "truncated", "skipped"
DEFAULT_WHOSE = "the epoch's "  # whose last batch is filled up, with one partition


@dataclass(frozen=True)
class LedgerEntry:
    """One sample's fate: ``status`` (padded, dropped, truncated, skipped), ``reason`` in
    words, ``tokens`` of the length field it concerns (repeated, or cut) when known, and
    for run-time skips the ``rank`` (and ``key``) that met it."""

    sample: int
    status: str
    reason: str
    tokens: int | None = None
    rank: int | None = None
    key: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Ledger:
    """An epoch's ledger (see the module docstring); :meth:`write` puts it beside a
    checkpoint as JSON lines."""

    epoch: int
    world_size: int
    num_samples: int
    entries: tuple[LedgerEntry, ...] = field(default=())

    def ids(self, status: str) -> tuple[int, ...]:
        """Sample ids with ``status``, one per entry, in entry order."""
        return tuple(e.sample for e in self.entries if e.status == status)

    def counts(self) -> dict[str, int]:
        """Entries per status (padded counts repeats, as ``report().padded_samples`` does)."""
        none = dict.fromkeys((PADDED, DROPPED, TRUNCATED, SKIPPED), 0)
        return none | Counter(e.status for e in self.entries)

    def with_skips(self, records: Iterable[SkipRecord]) -> Ledger:
        """This ledger plus the run-time skips of its epoch (from
        :func:`~shardloader.read.skips.merge_skips`)."""
        skips = tuple(
            LedgerEntry(r.sample, SKIPPED, r.reason, rank=r.rank, key=r.key)
            for r in records
            if r.epoch == self.epoch
        )
        return replace(self, entries=self.entries + skips)

    def write(self, path: str) -> None:
        """JSON lines: a header ``{"epoch", "world_size", "num_samples"}``, then one line
        per entry; written to a temporary name and renamed, like every file we write."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            head = {"epoch": self.epoch, "world_size": self.world_size}
            f.write(json.dumps({**head, "num_samples": self.num_samples}) + "\n")
            for e in self.entries:
                f.write(json.dumps(e.as_dict()) + "\n")
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: str) -> Ledger:
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
        if not lines or "epoch" not in lines[0]:
            raise UsageError(f"{path} is not a ledger written by Ledger.write")
        head, entries = lines[0], tuple(LedgerEntry(**e) for e in lines[1:])
        return cls(head["epoch"], head["world_size"], head["num_samples"], entries)


# ---------------------------------------------------------------------------------------------
# from the plan


def build(
    epoch: int,
    world_size: int,
    planning: EpochPlanner,
    plans: Sequence[EpochPlan],
    lengths: np.ndarray | None,
    collate_fn: Any,
) -> Ledger:
    """The ledger of an epoch's plan, ``plans`` every partition's (NOTE [the ledger comes from
    the plan]): pure, the same accounting as ``EpochPlanner.report``; ``ds.ledger(epoch)``
    calls it.  Token rows: documents whose tokens are repeated, dropped or cut (NOTE [the
    ledger of token rows])."""
    if planning.planner is not None and planning.planner.units == "rows":
        return _rows_ledger(epoch, world_size, planning, plans, lengths)
    # a lazy order, whole: the ledger lists samples anyway
    order, batches, acc = planning.accounted(epoch, plans, lengths, collate_fn)
    entries: list[LedgerEntry] = []
    several = len(plans) > 1
    for n, plan in enumerate(plans):
        whose = f"partition {n}'s " if several else ""
        entries += _padding(plan, planning, world_size, whose)
    entries += _dropped(plans, planning, acc.dropped, lengths)
    entries += _truncated(planning, collate_fn, order, acc.truncated, batches, lengths)
    return Ledger(epoch, world_size, int(order.size), tuple(entries))


def _padding(plan: Any, planning: Any, world: int, whose: str) -> Iterator[LedgerEntry]:
    n = plan.num_batches
    if plan.pad_in_last and n:
        last = batch_ids(plan.batches[n - 1])
        size = planning.batch_size
        why = f"repeated to fill {whose or DEFAULT_WHOSE}last batch to batch_size={size}"
        for i in last[last.size - plan.pad_in_last :].tolist():
            yield LedgerEntry(i, PADDED, why)
    for r, batch in enumerate(plan.repeats()):
        why = (
            f"{whose}global batch {n + r} repeats batch {r % n} so every one of {world} "
            "ranks has the same number of steps (uneven='pad')"
        )
        for i in batch_ids(batch).tolist():
            yield LedgerEntry(i, PADDED, why)


def _dropped(
    plans: Sequence[Any], planning: Any, dropped: Sequence[int], lengths: np.ndarray | None
) -> Iterator[LedgerEntry]:
    if not dropped:
        return
    left_out: dict[int, int] = {}  # sample -> batch that uneven='drop' left out
    for plan in plans:
        n, cut = plan.num_batches, plan.slots.dropped_batches
        for q in range(n - cut, n):
            for i in batch_ids(plan.batches[q]).tolist():
                left_out.setdefault(int(i), q)
    for i in dropped:
        tokens = None if lengths is None else int(lengths[i])
        if i in left_out:
            reason = (
                f"global batch {left_out[i]} left out so every rank has the same number of "
                "steps (uneven='drop')"
            )
        elif planning.planner is None:
            reason = (
                f"in the epoch's partial last batch of batch_size={planning.batch_size}, "
                "left out (uneven='drop')"
            )
        else:
            reason = planning.planner.explain_dropped(tokens) or "left out by the planner"
        yield LedgerEntry(int(i), DROPPED, reason, tokens)


def _truncated(
    planning: Any,
    collate_fn: Any,
    order: np.ndarray,
    truncated: Sequence[int],
    batches: Sequence[np.ndarray],
    lengths: np.ndarray | None,
) -> Iterator[LedgerEntry]:
    """One entry per truncated occurrence (NOTE [occurrences] in batching/base.py): of a
    document cut into segments, occurrence ``j`` keeps the segments delivered ``j`` times or
    more, so the last ones kept the least."""
    if not truncated or lengths is None:
        return
    segs = [b for b in batches if b.ndim == 2 and b.size]
    uniq, served = segment_counts(order, segs)
    planner = planning.planner
    limit = None if planner is None else planner.truncate_to
    if limit is None:
        limit = getattr(collate_fn, "max_length", None)
    cut_to = "" if limit is None else f"cut to max_length={limit}: "
    ids, times = np.unique(np.asarray(truncated, np.int64), return_counts=True)
    for i, r in zip(ids.tolist(), times.tolist(), strict=True):
        total = int(lengths[i])
        a, b = np.searchsorted(uniq[:, 0], [i, i + 1]) if len(uniq) else (0, 0)
        if b > a:  # segments: the occurrences delivered, most first; the last r are short
            m, span = served[a:b], uniq[a:b, 2] - uniq[a:b, 1]
            top = int(m.max())
            kept_each = [int(span[m >= j].sum()) for j in range(top - r + 1, top + 1)]
        else:
            kept_each = [total if limit is None else min(total, int(limit))] * r
        for kept in kept_each:
            own = None if planner is None else planner.explain_truncated(total, kept)
            reason = own or f"{cut_to}{kept} of {total} tokens delivered"
            yield LedgerEntry(i, TRUNCATED, reason, total - kept)


# ---------------------------------------------------------------------------------------------
# token rows


def _rows_ledger(
    epoch: int,
    world_size: int,
    planning: EpochPlanner,
    plans: Sequence[EpochPlan],
    lengths: np.ndarray | None,
) -> Ledger:
    """The ledger of a token-row epoch's plans (every partition's), pure like ``report()``."""
    if lengths is None:
        raise UsageError(
            f"the ledger of epoch {epoch}'s token rows needs every document's token count, "
            "which the shards' sidecars do not record; re-pack with --tokenizer (or "
            "--token-field for records that hold token ids)"
        )
    planner = planning.planner
    sizes = np.asarray(planning.shard_sizes, np.int64)
    lens = np.asarray(lengths, np.int64)
    lay = planner.layout(sizes, lengths)
    kept, planned, repeats = plans[0].delivered_before, plans[0].delivered_before, []
    for part, p in enumerate(plans):
        n = p.num_batches
        kept += p.kept()
        planned += list(p.batches[:n])
        repeats += [(part, b, n + r, r % n) for r, b in enumerate(p.repeats())]
    got = {
        name: lay.covered(lens, sizes, np.concatenate(b) if b else np.zeros(0, np.int64))
        for name, b in (("kept", kept), ("planned", planned))
    }
    # a mixture epoch holds only its rows (plan/rowmix.py)
    mixed = planning.order_source is not None
    scope = planning.order_source.order(epoch) if mixed else np.arange(lay.num_rows)
    got["rows"] = lay.covered(lens, sizes, scope)
    # a document's tokens in a mixture epoch's rows; the rest is another mixture epoch's
    whole = got["rows"] if mixed else lens
    entries = list(_repeated(planner, lay, lens, repeats, world_size, len(plans) > 1))
    entries += _cut(planner, whole, got)
    return Ledger(epoch, world_size, int(lens.size), tuple(entries))


def _repeated(
    planner: Any,
    lay: Any,
    lens: np.ndarray,
    repeats: list[tuple[int, np.ndarray, int, int]],
    world: int,
    several: bool,
) -> Iterator[LedgerEntry]:
    """A ``padded`` entry per (repeated row, document in it), in step order."""
    starts = np.zeros(lens.size + 1, np.int64)
    np.cumsum(lens, out=starts[1:])
    flags = "flagged __pad__" + (", labels -100" if planner.repeat_labels == "ignore" else "")
    for part, batch, q, source in repeats:
        rows = np.asarray(batch, np.int64)
        shard, lo, count = lay.windows(rows)
        whose = f"partition {part}'s " if several else ""
        for row, s, a, n in zip(rows.tolist(), shard, lo, count, strict=True):
            why = (
                f"row {row} of {whose}global batch {q} repeats batch {source} so every one of "
                f"{world} ranks has the same number of steps (uneven='pad'); {flags}"
            )
            g = int(lay.token_bases[s] + a)
            first = int(np.searchsorted(starts, g, side="right")) - 1
            last = int(np.searchsorted(starts, g + int(n), side="left"))
            for doc in range(first, last):
                tokens = min(int(starts[doc + 1]), g + int(n)) - max(int(starts[doc]), g)
                if tokens > 0:
                    yield LedgerEntry(doc, PADDED, why, tokens)


def _cut(planner: Any, lens: np.ndarray, got: dict[str, np.ndarray]) -> Iterator[LedgerEntry]:
    """A ``dropped`` or ``truncated`` entry per document not delivered whole, naming why."""
    kept = got["kept"]
    for doc in np.flatnonzero((kept < lens) & (lens > 0)).tolist():
        total, have = int(lens[doc]), int(kept[doc])
        why = []
        if got["rows"][doc] < total:
            why.append(f"the shard's last partial row (remainder={planner.remainder!r})")
        if got["planned"][doc] < got["rows"][doc]:
            why.append(f"the epoch's partial last batch (tail={planner.tail!r})")
        if kept[doc] < got["planned"][doc]:
            why.append(
                "batches left out so every rank has the same number of steps (uneven='drop')"
            )
        cause = " and ".join(why)
        if have == 0:
            status, what = DROPPED, f"all {total} tokens"
        else:
            status, what = TRUNCATED, f"{have} of {total} tokens delivered; the rest"
        yield LedgerEntry(doc, status, f"{what} in {cause}, left out", total - have)


# ---------------------------------------------------------------------------------------------
# run-time skips


@dataclass(frozen=True)
class SkipRecord:
    """A sample ``on_error="skip"`` replaced at run time."""

    epoch: int
    sample: int
    key: str
    rank: int
    worker: int
    reason: str
