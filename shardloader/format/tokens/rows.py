"""The token format's batch read: rows sliced out of staged token shards' memory maps.

A token shard holds its documents' tokens end to end, so it holds ``rows`` windows of
``seq_len`` tokens just as a tar shard holds samples (NOTE [what a row is] in
:mod:`shardloader.batching.blocks`); LitData's ``TokensLoader`` reads its chunks the same way.
:class:`TokenRows` is what the pass (:mod:`shardloader.read.samplepass`) loads rows through:
each shard's token array, opened from the shard set's staged copy and checked chunk by chunk
(against the shard's table, once) before any of its rows is copied out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardloader.errors import ShardChangedError, located
from shardloader.format.tokens.format import TokenStream

__all__ = ["TokenRows"]

STREAMS = 128  # open token shards per pass


class TokenRows:
    """The token arrays (:attr:`tokens`, by shard) of the shards a pass reads rows of, staged
    through its shard set, checked on first touch."""

    def __init__(self, shards: Any, lengths: np.ndarray, shard_sizes: np.ndarray) -> None:
        self.shards = shards
        self.open: dict[int, TokenStream] = {}
        self.tokens: dict[int, np.ndarray] = {}
        self.checked: set[int] = set()  # open shards whose every token chunk is checked
        self._lengths = lengths
        self._starts = np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64)

    def _drop(self, shard: int) -> None:
        self.open.pop(shard).close()
        del self.tokens[shard]
        self.checked.discard(shard)

    def _open(self, shard: int, needed: set[int]) -> None:
        """Open ``shard``; past :data:`STREAMS` open ones, close the least recently used that
        the rows being loaded do not need."""
        idle = [s for s in self.open if s not in needed]
        for old in idle[: max(len(self.open) - STREAMS + 1, 0)]:
            self._drop(old)
        path = self.shards.local_file(shard)
        a, b = int(self._starts[shard]), int(self._starts[shard + 1])
        verify = self.shards.options.verify_samples
        stream = TokenStream(path, verify, b - a, int(self._lengths[a:b].sum()))
        self.open[shard], self.tokens[shard] = stream, stream.tokens

    def load(self, shard: np.ndarray, lo: np.ndarray, n: np.ndarray) -> dict[int, np.ndarray]:
        """Open the shards of these rows (``shard`` -1: a padding row; tokens ``lo .. lo + n``
        of the shard's stream), check the token chunks they touch, and return :attr:`tokens`
        (every shard stays open while the rows are copied out)."""
        shards = set(shard.tolist())
        shards.discard(-1)
        for s in shards & self.open.keys():  # most recently used last
            self.open[s] = self.open.pop(s)
            if (change := self.open[s].file.changed()) is not None:  # NOTE [no SIGBUS]
                self._drop(s)
                if not self.shards.restage(s):  # a staged copy: opened again below
                    raise ShardChangedError(f"{self.shards.describe(s)}: {change}")
        for s in shards - self.checked:
            with located(self.shards.describe(s)):  # a shard a batch, until all is checked
                if s not in self.open:
                    self._open(s, shards)
                stream = self.open[s]
                mine = shard == s
                stream.check_tokens(lo[mine], lo[mine] + n[mine])
            if stream.all_checked:
                self.checked.add(s)
        return self.tokens

    def close(self) -> None:
        for stream in self.open.values():
            stream.close()
        self.open.clear()
        self.tokens.clear()
