"""The small values the pack stages pass around: input files, planned samples, the text rule.

Named tuples, not dataclasses: millions are made in the main process and pickled to workers, and
tuples are ~3x cheaper both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["FileRef", "SampleRef", "InputFile", "TextRule"]


class FileRef(NamedTuple):
    """A field whose bytes are a whole input file; read by the worker that writes the shard."""

    url: str  # what the worker opens
    rel: str  # path relative to SRC: goes into messages, skip reports and resume digests
    size: int  # from stat/find; the worker checks the bytes it reads against it


class SampleRef(NamedTuple):
    """One planned sample: key, fields in extension order, and where it came from."""

    key: str
    fields: tuple[tuple[str, FileRef | bytes], ...]
    file: str = ""  # record samples: the record file (relative to SRC); empty for file samples
    where: str = ""  # record samples: "line 12" / "row 3"


class InputFile(NamedTuple):
    """A listed input file: path relative to SRC, URL, size from stat/find."""

    rel: str
    url: str
    size: int


@dataclass(frozen=True)
class TextRule:
    """Where a sample's text is, tried in order: ``("field", ext)`` or ``("json", key)``.

    Decided once by the layout in the main process; every shard writer measures with it.
    """

    candidates: tuple[tuple[str, str], ...]
    length_field: str  # manifest ``length_field``: ``tokens`` when tokenized
