"""A mixture of token-row sources (``Mixture(..., planner=TokenBlocks(...))``).

NOTE [token rows mix]: a row is ``seq_len`` tokens of one source, cut from that source's token
stream exactly as :class:`~shardloader.batching.blocks.TokenBlocks` cuts one dataset's (a row
never straddles shards, so a source's rows are the rows of its own shards).  The mixture blends
*rows* instead of documents: each source's own epochs order its rows as a single dataset's
epoch would, and the exact blend of :mod:`shardloader.plan.blend` interleaves them, so after
any prefix of the stream (each global batch) every source has had its weight's share of the
rows within one row, which is its share of the tokens within one row (``seq_len`` tokens; a
shard's last, partial row under ``remainder="pad"`` counts as a row).  Source ``s``'s row
``i`` is virtual row ``row_offset[s] + i``, which is the global row id of the virtual
manifest's layout (sources' shards in order), so planning, the rank and worker split, elastic
resume and the row load stage of the pass (:mod:`shardloader.read.samplepass`, through
:class:`~shardloader.read.mixed.MixedShards`) work on the mixed rows unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardloader.errors import UsageError

__all__ = ["source_rows", "row_tokens", "epoch_tokens"]


def source_rows(
    planner: Any,
    names: Sequence[str],
    opened: Sequence[tuple[Any, str, Any]],
    load: Callable[..., Any],
) -> tuple[tuple[tuple[int, ...], ...], list[np.ndarray]]:
    """Per source the rows of each of its shards (what its own epochs order), and its
    documents' token counts (``load``: :func:`shardloader.read.lengths.load_lengths`, handed
    in: the plan imports no read path); refuses a source that is no token dataset."""
    sizes, found = [], []
    for name, (m, base, read) in zip(names, opened, strict=True):
        if m.format != "tokens" or m.length_field is None:
            raise UsageError(
                f"source {name!r} holds {m.format} shards without a token stream, but "
                f"{type(planner).__name__} mixes rows of token shards: re-pack it with "
                "`shardloader pack SRC OUT --format tokens` and --tokenizer or --token-field"
            )
        lengths = np.asarray(load(m, base, read, required=True), np.int64)
        rows = planner.layout(np.asarray(m.shard_sizes, np.int64), lengths).rows_per_shard
        if not int(rows.sum()):
            raise UsageError(
                f"source {name!r} has no row of {planner.seq_len} tokens "
                f"(remainder={planner.remainder!r}): it cannot take a share of the rows"
            )
        sizes.append(tuple(int(r) for r in rows))
        found.append(lengths)
    return tuple(sizes), found


def row_tokens(planner: Any, shard_sizes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Real tokens of every virtual row (``seq_len``, less in a shard's partial last row)."""
    lay = planner.layout(shard_sizes, lengths)
    return lay.windows(np.arange(lay.num_rows, dtype=np.int64))[2]


def epoch_tokens(
    planner: Any,
    shard_sizes: np.ndarray,
    lengths: np.ndarray | None,
    plans: Sequence[Any],
    rows: np.ndarray | None = None,
) -> dict[str, int]:
    """The report's token fields of a token-row epoch (``plans``: every partition's), by
    :meth:`~shardloader.batching.blocks.TokenBlocks.report_stream`; ``rows``: a mixture
    epoch's rows (all partitions), a document's tokens outside them belong to another
    mixture epoch."""
    kept = plans[0].delivered_before + [b for p in plans for b in p.kept()]
    repeats = [b for p in plans for b in p.repeats()]
    counts = planner.report_stream(shard_sizes, lengths, kept, repeats, scope=rows)
    for link, taken in plans[0].earlier:  # slots of rows delivered with another shape
        counts["token_slots"] += len(taken) * planner.row_slots(link.planner)
    return counts
