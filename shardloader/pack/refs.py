"""The small values the pack stages pass around: input files and planned samples.

Named tuples, not dataclasses: millions are made in the main process and pickled to workers, and
tuples are ~3x cheaper both ways.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["FileRef", "SampleRef", "InputFile"]


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
