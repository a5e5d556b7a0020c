"""The ledger of a token-row epoch (:class:`~shardloader.batching.blocks.TokenBlocks`): which
documents' tokens were repeated, dropped or cut, and why.

Rows are windows of a shard's token stream, so a document may be delivered in part.  The
entries add up to ``ds.report()``'s token counts: a ``padded`` entry per (repeated row,
document it holds) with the tokens of that document the repeat delivers again (their sum is
``repeated_tokens``; NOTE [flagged repeats] in :mod:`shardloader.batching.blockchunks`), and one
``dropped`` or ``truncated`` entry per document of which nothing, or only a part, is
delivered (as ``dropped_samples``/``truncated_samples``, with ``dropped_tokens`` and
``truncated_tokens``).  The reason names what cut it: the shard's last partial row
(``remainder="drop"``), the epoch's partial last batch (``tail="drop"``) or a batch left out
for equal steps (``uneven="drop"``).  A mixture epoch (NOTE [token rows mix] in
:mod:`shardloader.plan.rowmix`) holds some of its sources' rows: a document counts only its
tokens in those rows, the rest belongs to other mixture epochs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.batching.blocks import _covered
from shardloader.errors import UsageError
from shardloader.plan.ledger import DROPPED, PADDED, TRUNCATED, Ledger, LedgerEntry

if TYPE_CHECKING:
    from shardloader.plan.epoch import EpochPlan, EpochPlanner

__all__ = ["build_rows"]


def build_rows(
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
    earlier = [b for _, taken in plans[0].earlier for b in taken]
    kept, planned, repeats = list(earlier), list(earlier), []
    for part, p in enumerate(plans):
        s, n = p.slots, p.num_batches
        kept += list(p.batches[: n - s.dropped_batches])
        planned += list(p.batches[:n])
        repeats += (
            [(part, p.batches[r % n], n + r, r % n) for r in range(s.padded_batches)] if n else []
        )
    got = {}
    for name, batches in (("kept", kept), ("planned", planned)):
        rows = np.zeros(lay.num_rows, bool)
        if batches:
            rows[np.concatenate(batches)] = True
        got[name] = _covered(lay, lens, sizes, rows)
    scope = np.ones(lay.num_rows, bool)
    if planning.order_source is not None:  # a mixture epoch holds only its rows (plan/rowmix.py)
        scope[:] = False
        scope[planning.order_source.order(epoch)] = True
    got["rows"] = _covered(lay, lens, sizes, scope)
    # a document's tokens in a mixture epoch's rows; the rest is another mixture epoch's
    whole = lens if planning.order_source is None else got["rows"]
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
    for part, batch, q, source in repeats:
        rows = np.asarray(batch, np.int64)
        shard, lo, count = lay.windows(rows)
        whose = f"partition {part}'s " if several else ""
        for row, s, a, n in zip(rows.tolist(), shard, lo, count, strict=True):
            g = int(lay.token_bases[s] + a)
            first = int(np.searchsorted(starts, g, side="right")) - 1
            last = int(np.searchsorted(starts, g + int(n), side="left"))
            for doc in range(first, last):
                tokens = min(int(starts[doc + 1]), g + int(n)) - max(int(starts[doc]), g)
                if tokens > 0:
                    yield LedgerEntry(
                        doc,
                        PADDED,
                        f"row {row} of {whose}global batch {q} repeats batch {source} so every "
                        f"one of {world} ranks has the same number of steps (uneven='pad'); "
                        "flagged __pad__"
                        + (", labels -100" if planner.repeat_labels == "ignore" else ""),
                        tokens,
                    )


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
            yield LedgerEntry(doc, DROPPED, f"all {total} tokens in {cause}, left out", total)
        else:
            yield LedgerEntry(
                doc,
                TRUNCATED,
                f"{have} of {total} tokens delivered; the rest in {cause}, left out",
                total - have,
            )
