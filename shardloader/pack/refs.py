"""The small values the pack stages pass around: input files, planned samples, the text rule.

Named tuples, not dataclasses: millions are made in the main process and pickled to workers, and
tuples are ~3x cheaper both ways.  Lines of plain line files travel as :class:`LineRun` s, a
few arrays per run of lines, never one object per line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np

__all__ = ["InputFile", "SampleRef", "LineRun", "TextRule"]


class InputFile(NamedTuple):
    """A listed input file; as a sample field, one whose bytes are the whole file, read by the
    worker that writes the shard."""

    rel: str  # path relative to SRC: goes into messages, skip reports and resume digests
    url: str  # what the worker opens
    size: int  # from stat/find; the worker checks the bytes it reads against it


class SampleRef(NamedTuple):
    """One planned sample: key, fields in extension order, and where it came from."""

    key: str
    fields: tuple[tuple[str, InputFile | bytes], ...]
    file: str = ""  # record samples: the record file (relative to SRC); empty for file samples
    where: str = ""  # record samples: "line 12" / "row 3"


class LineRun(NamedTuple):
    """Consecutive non-blank lines of one uncompressed line file, one sample each, by position.

    The main process finds where lines are (to plan shards); the worker that writes the shard
    reads the byte range itself (NOTE [line runs] in pack/layouts/lines.py).  Sample ``i`` has
    key ``f"{stem}/{numbers[i]:09d}"`` and field ``kind`` = the ``lengths[i]`` bytes at
    ``starts[i]`` (no line terminator).
    """

    url: str  # what the worker opens
    rel: str  # path relative to SRC (messages, skip reports, resume digests)
    kind: str  # ``json`` or ``txt``: the field name
    stem: str  # key prefix: the path without its suffix
    size: int  # file size when listed; the worker checks it
    numbers: np.ndarray  # int64, 1-based line numbers
    starts: np.ndarray  # int64, byte offset of each line
    lengths: np.ndarray  # int64, bytes of each line without its terminator

    @property
    def num_lines(self) -> int:
        return len(self.numbers)

    def part(self, lo: int, hi: int) -> LineRun:
        """Lines ``lo``..``hi`` (exclusive) of this run."""
        return self._replace(
            numbers=self.numbers[lo:hi], starts=self.starts[lo:hi], lengths=self.lengths[lo:hi]
        )

    def key(self, i: int) -> str:
        return f"{self.stem}/{int(self.numbers[i]):09d}"

    @property
    def span(self) -> tuple[int, int]:
        """(first byte, end byte) of the run in its file, terminators inside it included."""
        return int(self.starts[0]), int(self.starts[-1] + self.lengths[-1])


@dataclass(frozen=True)
class TextRule:
    """Where a sample's text is, tried in order: ``("field", ext)`` or ``("json", key)``.

    Decided once by the layout in the main process; every shard writer measures with it.
    """

    candidates: tuple[tuple[str, str], ...]
    length_field: str  # manifest ``length_field``: ``tokens`` when tokenized
