"""A shard's sample index carried inside the shard, so that one GET brings both.

A zstd-compressed shard may end with a *skippable frame* (RFC 8878, section 3.1.2): every zstd
decoder (``zstd -d``, python-zstandard, webdataset through a ``zstd -d`` pipe) passes over it,
so the decompressed tar is unchanged and older shardloader versions read such shards as
before.  Its content is the sample index as Arrow IPC bytes (zstd buffers, as the sidecar's),
then its SHA-256 and a footer (its length and ``SLI2``), so a reader finds it from the last
bytes of the stored object alone:

    <u32 LE 0x184D2A5B> <u32 LE n>  <Arrow IPC index: m bytes> <SHA-256 of it> <u32 LE m> b"SLI2"

The digest tells a damaged copy (in a shard whose producer hashed it after the damage) from a
whole one, so a reader takes its sidecar instead of failing on it or, worse, trusting changed
offsets or checksums; frames written before it (``SLI1``: no digest) are still read, and a copy
that fails its manifest entry is passed over the same way (read/indexes.py).  ``verify`` also
compares the copy with the sidecar.

The sidecar (``*.idx.arrow``) is still written and stays the reference: the manifest's
``index_sha256`` is the sidecar's, whose schema metadata also holds pack's resume record (which
names the shard's own SHA-256, so it cannot be inside the shard).  The embedded copy is trusted
only as part of a stored shard whose SHA-256 matched the manifest, and is checked against the
manifest entry like a sidecar before use.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import NamedTuple

__all__ = [
    "FOOTER",
    "MAGIC",
    "TAIL_KEEP",
    "Carried",
    "carried_index",
    "index_frame",
    "tail_to_keep",
]

MAGIC = 0x184D2A5B  # one of the 16 skippable-frame magic numbers (0x184D2A50..5F)
FOOTER = b"SLI2"
_DIGEST = {FOOTER: 32, b"SLI1": 0}  # the bytes of the index's SHA-256 before the footer
TAIL_KEEP = 8 << 20  # the last bytes a stager keeps to find an embedded index in
_HEAD = struct.Struct("<II")
_FOOT = struct.Struct("<I4s")


def tail_to_keep(index_bound: int) -> int:
    """The last bytes of a stored shard to keep to find a carried index of at most
    ``index_bound`` bytes (its frame adds 48), never more than :data:`TAIL_KEEP`."""
    return min(TAIL_KEEP, index_bound + 64)


def index_frame(index: bytes) -> bytes:
    """The skippable frame that carries ``index`` (Arrow IPC bytes of a SampleIndex)."""
    content = index + hashlib.sha256(index).digest() + _FOOT.pack(len(index), FOOTER)
    return _HEAD.pack(MAGIC, len(content)) + content


class Carried(NamedTuple):
    """The index bytes of a shard's frame, and whether they hash to the SHA-256 the frame
    carries (an ``SLI1`` frame carries none: True): readers and ``verify`` tell a damaged copy
    from none."""

    data: bytes
    whole: bool


def carried_index(tail: Callable[[int], bytes] | bytes) -> Carried | None:
    """The index in the frame the stored shard ends with, or None when it ends with no whole
    frame of ours.

    ``tail`` is the shard's last bytes, or a function giving its last ``n`` bytes (fewer when
    it has fewer): the footer is read first, then only as much as the frame takes.
    """
    last = tail if callable(tail) else (lambda n, data=tail: data[-n:])
    foot = last(_FOOT.size)
    if len(foot) < _FOOT.size or foot[-4:] not in _DIGEST:
        return None
    (length, tag) = _FOOT.unpack(foot)
    content = length + _DIGEST[tag] + _FOOT.size
    frame = last(_HEAD.size + content)
    if len(frame) < _HEAD.size + content:
        return None  # longer than what the stager kept
    magic, size = _HEAD.unpack_from(frame, 0)
    if magic != MAGIC or size != content:
        return None
    index = frame[_HEAD.size : _HEAD.size + length]
    digest = frame[_HEAD.size + length : _HEAD.size + length + _DIGEST[tag]]
    return Carried(index, not digest or hashlib.sha256(index).digest() == digest)
