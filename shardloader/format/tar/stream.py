"""Reading tar streams: a small header parser that is enough for our shards and for shards
written by webdataset or GNU tar (ustar, pax ``x``/``g`` records, GNU long names).

Members are walked front to back in bounded chunks: a member's size is checked against the
stream's limit from its header, before any of it is decompressed (NOTE [bounded formats] in
format/base.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import BinaryIO

import xxhash

from shardloader.errors import ShardError
from shardloader.format.base import Sample
from shardloader.format.compress import CHUNK, Bounded, check_size, decompressed, decompressing
from shardloader.format.keys import check_key
from shardloader.format.tar.layout import EMPTY

__all__ = [
    "BLOCK",
    "SpanDigests",
    "iter_members",
    "iter_samples",
    "iter_tar",
    "split_key",
    "walk_members",
]

BLOCK = 512
_MAX_META = 1 << 20  # pax / GNU long-name records: names and a few numbers, never this big


def split_key(name: str) -> tuple[str, str] | None:
    """webdataset's rule: the key is the path up to the first dot of the basename."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= slash + 1:
        return None
    return name[:dot], name[dot + 1 :]


def _pax_records(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    try:
        while pos < len(data):
            space = data.index(b" ", pos)
            length = int(data[pos:space])
            if length <= space - pos:
                raise ValueError(f"record length {length}")
            record = data[space + 1 : pos + length - 1]
            k, _, v = record.partition(b"=")
            out[k.decode("utf-8")] = v.decode("utf-8", "surrogateescape")
            pos += length
    except (ValueError, UnicodeDecodeError) as err:
        raise ShardError(f"corrupt pax header ({err})") from err
    return out


_ZERO_BLOCK = b"\0" * BLOCK
_PAX_TYPES = (b"x", b"g")


def _octal(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for big sizes
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip()
    return int(digits, 8) if digits else 0


def _parse_header(header: bytes) -> tuple[str, int, bytes]:
    """(name, size, typeflag) of one 512-byte header, checksum verified.

    Hand-rolled because ``tarfile.TarInfo.frombuf`` costs more than reading the sample.
    """
    try:
        stored = _octal(header[148:156])
        size = _octal(header[124:136])
    except ValueError as err:
        raise ShardError("corrupt tar header (bad number field)") from err
    if stored != sum(header) - sum(header[148:156]) + 256:
        raise ShardError("corrupt tar header (checksum mismatch)")
    name = header[:100].split(b"\0", 1)[0]
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape"), size, header[156:157]


def walk_members(
    stream: Bounded, require_end: bool = True, max_member: int | None = None
) -> Iterator[tuple[str, int]]:
    """Yield (name, size) of each regular file, with ``stream`` at the start of its data.

    The consumer may read up to ``size`` bytes from ``stream``; the rest and the padding are
    skipped in bounded chunks when it asks for the next member, so no member is ever held
    whole unless the consumer reads it.  Raise ShardError on any malformation, on a member
    larger than ``max_member`` and on anything past the stream's limit.  A whole shard ends with
    a zero block, and is read to its end; a single sample's bytes (``require_end=False``)
    don't.
    """
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        header = stream.read(BLOCK)
        if header == _ZERO_BLOCK:
            if require_end:
                _read_trailer(stream, max_member)
            return
        if not header:
            if require_end:
                raise ShardError("truncated shard: no end-of-archive marker")
            return
        if len(header) != BLOCK:
            raise ShardError("truncated shard: partial tar header")
        name, size, kind = _parse_header(header)
        if "size" in pax:
            try:
                size = int(pax["size"])
            except ValueError as err:
                raise ShardError(f"corrupt pax size {pax['size']!r}") from err
        if size < 0:
            raise ShardError("corrupt tar header (negative size)")
        padded = size + (-size % BLOCK)
        if kind in _PAX_TYPES or kind == b"L":
            if size > _MAX_META:
                raise ShardError(f"a {size:,}-byte tar metadata record; corrupt shard")
            data = stream.read_exact(size, f"metadata of member {name!r}")
            stream.skip(padded - size, f"padding of member {name!r}")
            if kind == b"x":
                pax = _pax_records(data)
            elif kind == b"L":  # GNU long name
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue
        name = pax.get("path") or long_name or name
        pax, long_name = {}, None
        if kind not in (b"0", b"\0"):  # links, devices, fifos, folders: never sample data
            stream.skip(padded, f"member {name!r}")
            continue
        check_size(f"member {name!r}", size, max_member)
        stream.reserve(padded, f"member {name!r}")
        start = stream.pos
        yield name, size
        consumed = stream.pos - start
        stream.skip(padded - consumed, f"member {name!r}")


def _read_trailer(stream: Bounded, max_member: int | None) -> None:
    """Read what follows the end-of-archive marker (more zero blocks: GNU tar pads to 10 KiB
    records) to the stream's end, so a stored stream cut short fails here as anywhere else
    (``compress.decompressed``); bounded by the stream's limit (the manifest's ``raw_bytes``),
    or without one (``index``) by ``max_member``."""
    trailing = 0
    bound = max_member if stream.limit is None else None
    while chunk := stream.read(CHUNK):
        trailing += len(chunk)
        stream.reserve(0, "the data after the end-of-archive marker")
        if bound is not None and trailing > bound:
            raise ShardError(
                f"more than {bound:,} bytes after the end-of-archive "
                "marker; the shard is corrupt or hostile (a decompression bomb?)"
            )


def iter_members(
    stream: Bounded, require_end: bool = True, max_member: int | None = None
) -> Iterator[tuple[str, bytes]]:
    """Yield (name, data) of regular files; each member is read whole (bounded by the caller)."""
    for name, size in walk_members(stream, require_end, max_member):
        yield name, stream.read_exact(size, f"member {name!r}")


def iter_samples(members: Iterator[tuple[str, bytes]]) -> Iterator[Sample]:
    key: str | None = None
    fields: dict[str, bytes] = {}
    for name, data in members:
        parts = split_key(name)
        if parts is None:
            continue  # no extension: not a sample member (webdataset skips these too)
        k, ext = parts
        if k != key:
            if key is not None:
                yield key, fields
            check_key(k)
            key, fields = k, {}
        if ext == EMPTY:  # the marker of a sample with no fields (format/tar/layout.py)
            continue
        if ext in fields:
            raise ShardError(f"sample {k!r} has two members with extension {ext!r}")
        fields[ext] = data
    if key is not None:
        yield key, fields


def iter_tar(
    src: BinaryIO,
    compression: str,
    limit: int | None = None,
    max_member: int | None = None,
    spans: SpanDigests | None = None,
) -> Iterator[tuple[Sample, int | None]]:
    """Stream the samples of a stored tar shard (compressed or not), each with the digest of its
    sidecar span in ``spans`` (None without): what ``verify`` compares with the sidecar.

    ``limit`` bounds the uncompressed bytes read (the manifest's ``raw_bytes``), ``max_member``
    the bytes of any one member; both are checked from the headers, before decompressing.
    """
    feed = None if spans is None else spans.feed
    stream = Bounded(decompressed(src, compression), limit, on_data=feed)
    with decompressing():
        for n, sample in enumerate(iter_samples(iter_members(stream, True, max_member))):
            yield sample, None if spans is None else spans.digest(n)


class SpanDigests:
    """XXH3-64 of byte spans ``[offset, offset + size)`` of a stream fed front to back
    (:meth:`feed`), spans in the sidecar's order: what the tar reader checks per sample,
    computed while the stream passes.  Spans must not overlap nor go backwards, as pack and
    ``index`` write them; one that does is a ShardError."""

    def __init__(self, offsets: Sequence[int], sizes: Sequence[int]) -> None:
        self._spans = [(a, a + n) for a, n in zip(offsets, sizes, strict=True)]
        self._pos = 0
        self._hash: xxhash.xxh3_64 | None = None
        self.digests: list[int] = []  # of the spans passed so far

    def feed(self, data: bytes) -> None:
        first, n = self._pos, len(data)
        self._pos += n
        at = 0  # in ``data``
        view = memoryview(data)
        while len(self.digests) < len(self._spans):
            a, b = self._spans[len(self.digests)]
            if self._hash is None:
                if a < first + at:
                    raise ShardError(
                        f"the sample index puts sample {len(self.digests)} at "
                        f"bytes {a}..{b}, before the end of the sample it lists before it; "
                        "the sidecar does not match the shard"
                    )
                if a >= first + n:
                    return
                at, self._hash = a - first, xxhash.xxh3_64()
            stop = min(b, first + n)
            self._hash.update(view[at : stop - first])
            at = stop - first
            if stop < b:
                return
            self.digests.append(self._hash.intdigest())
            self._hash = None

    def digest(self, n: int) -> int:
        """Span ``n``'s digest; a ShardError when the stream has not passed its end."""
        if n >= len(self.digests):
            a, b = self._spans[n] if n < len(self._spans) else (-1, -1)
            raise ShardError(
                f"sample {n} of the stream ends before bytes {a}..{b}, where the "
                "sample index puts it; the sidecar does not match the shard"
            )
        return self.digests[n]
