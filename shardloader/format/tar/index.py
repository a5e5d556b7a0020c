"""Index an existing tar shard in place: what ``shardloader index`` asks the tar format.

The uncompressed tar is walked once to record every sample's key, byte offset, size (from the
first header of its first member to the padding of its last) and checksum (XXH3-64): the same
sidecar ``pack`` writes.  Members are skipped in bounded chunks, never held in memory; a member
larger than ``max_member`` (or trailing data after the end-of-archive marker larger than that)
is refused from its header, before it is decompressed, and so is a member whose name would give
a sample key that could escape a directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import BinaryIO, cast

import xxhash

from shardloader.errors import ShardError
from shardloader.format.base import ScannedShard
from shardloader.format.compress import Bounded, decompressed, decompressing
from shardloader.format.keys import not_utf8, unsafe_key_reason
from shardloader.format.recorder import IndexRecorder
from shardloader.format.tar.layout import EMPTY
from shardloader.format.tar.stream import BLOCK, split_key, walk_members

__all__ = ["scan_tar"]


class _Hashes:
    """The checksum of the sample being scanned, kept both ways.

    A sample's byte range starts where the previous regular member ended, but whether the
    bytes after that point (folders, pax headers, the next header) begin a new sample is known
    only once the next member's name is parsed.  So two hashes run over them: ``cont`` as if
    they continue the current sample, ``new`` as if they start the next one.
    """

    def __init__(self) -> None:
        self.cont = xxhash.xxh3_64()
        self.new = xxhash.xxh3_64()

    def feed(self, data: bytes) -> None:
        self.cont.update(data)
        self.new.update(data)


def _unsafe_member(name: str, key: str, reason: str) -> ShardError:
    if not_utf8(name):  # a reason of its own: nothing to do with directories
        return ShardError(
            f"member name {name.encode('utf-8', 'surrogateescape')!r} is not UTF-8, so it "
            "gives no sample key; rename the member, or unpack the shard and `shardloader pack` "
            "the folder (pack percent-escapes such names)"
        )
    return ShardError(
        f"member {name!r} gives sample key {key!r}, which {reason}: it could escape a "
        "directory when samples are written to disk, so shardloader refuses it; rewrite the "
        "shard with relative member names (no '..', no leading '/')"
    )


def scan_tar(
    src: BinaryIO,
    compression: str,
    max_member: int | None,
    length_fields: Sequence[str] = (),
) -> ScannedShard:
    """Index the stored tar shard ``src``; a sample's length is the size of its first member
    whose extension is in ``length_fields`` (all samples must have one, else no lengths)."""
    recorded = IndexRecorder()
    seen: dict[str, int] = {}
    hashes = _Hashes()
    tar = Bounded(decompressed(src, compression), on_data=hashes.feed)
    key: str | None = None
    exts: set[str] = set()
    start = end = text = run = mark = 0
    has_text = False

    def finish() -> None:
        assert key is not None
        recorded.add(key, start, end - start, text if has_text else None, run)

    with decompressing():
        for name, size in walk_members(tar, True, max_member):
            parts = split_key(name)
            if parts is not None:
                k, ext = parts
                if k != key:
                    if key is not None:
                        finish()
                    problem = unsafe_key_reason(k)
                    if problem is not None:
                        raise _unsafe_member(name, k, problem)
                    key, exts, start, has_text = k, set(), mark, False
                    # this sample's bytes so far: those since `mark`
                    hashes.cont = cast(xxhash.xxh3_64, hashes.new.copy())
                if ext in exts:
                    raise ShardError(f"sample {k!r} has two {ext!r} members")
                exts.add(ext)
                if ext != EMPTY:  # the marker of a sample with no fields is no field
                    seen[ext] = seen.get(ext, 0) + 1
                if ext in length_fields and not has_text:
                    text, has_text = size, True
            tar.skip(size + (-size % BLOCK), f"member {name!r}")  # streamed, never held
            if parts is not None:
                run, end = hashes.cont.intdigest(), tar.pos
            hashes.new, mark = xxhash.xxh3_64(), tar.pos
        if key is not None:
            finish()
    return ScannedShard(recorded.index(), seen, tar.pos)
