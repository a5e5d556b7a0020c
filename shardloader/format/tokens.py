"""Token shards: each shard's token ids as one contiguous array, so a row is a memory-map slice.

Why a format of its own: tar and Arrow shards keep each document's tokens next to its other
fields, so a 2048-token row of a packed batch is rebuilt from many samples in Python.  Here the
token field of every sample of a shard (the ``tokens`` field ``pack --tokenizer`` adds) lies end
to end in one array, and a row of any length is one slice of the staged shard's memory map
(:mod:`shardloader.batching.blocks`); each document's place in it is the running sum of the
sidecar's ``length`` column.  The other fields stay readable sample by sample, so the shard is
a complete dataset shard: ``verify``, ``inspect``, per-sample reading and every planner work.

Layout of the uncompressed shard (compressed as a whole with zstd or gzip, or stored as is)::

    header   128 bytes: magic, version, token dtype, sample count, region sizes, chunk size,
             the name of the token field
    table    1008 XXH3-64 checksums of the token region's chunks (1/1008th of it each)
    tokens   the token field of every sample, concatenated, little-endian, from byte 8192
             (page-aligned: a row of 2048 uint16 tokens is one memory page)
    records  per sample: key, then each field's name and size, and its bytes, except those
             of the token field, which are in ``tokens``

The sidecar records per sample the record's offset, its size plus its token bytes, its token
count (``length``) and an XXH3-64 of its record and its tokens (checked when a sample is read);
a block reader checks each chunk of the token region it touches against the table, once.

Sizes are exact and additive (``sample_raw_size``): a sample adds its record framing and all
its field bytes, wherever they go; a shard adds the 8,192 bytes of header and table.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import xxhash

from shardloader.errors import ChecksumError, ShardError, UsageError
from shardloader.format.base import Format, Sample, WrittenShard
from shardloader.format.compress import (
    CHUNK,
    DECOMPRESS_ERRORS,
    CompressedSink,
    decompressed,
    stage_stream,
    too_big,
)
from shardloader.format.registry import register_format
from shardloader.keys import unsafe_key_reason
from shardloader.manifest import SampleIndex
from shardloader.schema import unsafe_key_error

if TYPE_CHECKING:
    from shardloader.manifest import FieldInfo, ShardInfo

__all__ = [
    "FORMAT",
    "HEADER_BYTES",
    "TOKEN_FIELD",
    "TokenFormat",
    "TokenShardReader",
    "TokenShardWriter",
    "TokenStream",
    "stream_field",
]

MAGIC = b"SLTOKENS"
VERSION = 1
TOKEN_FIELD = "tokens"  # the field pack --tokenizer adds; preferred when several are tokens
CHUNKS = 1008  # token-region checksums per shard: a fixed table keeps sizes additive
_HEAD = struct.Struct("<8sHBBB3xQQQQ16x")  # 64 bytes; then 64 bytes of field name
_NAME_BYTES = 64
HEADER_BYTES = _HEAD.size + _NAME_BYTES + 8 * CHUNKS  # 8192: the token region is page-aligned
_U16, _U64 = struct.Struct("<H"), struct.Struct("<Q")
_MAX_KEY, _MAX_NAME, _MAX_FIELDS = 0xFFFF, 0xFF, 0xFF


def stream_field(fields: Mapping[str, FieldInfo]) -> str | None:
    """The field whose bytes go to the token region: the only ``tokens``-codec field, or the
    one named ``tokens`` among several; None when there is none (every field is a record)."""
    names = sorted(n for n, info in fields.items() if info.codec == "tokens")
    if len(names) > 1:
        names = [n for n in names if n == TOKEN_FIELD]
    if len(names) != 1 or len(names[0].encode()) > _NAME_BYTES:
        return None
    return names[0]


def _dtype(info: FieldInfo | None) -> np.dtype:
    return np.dtype(info.dtype if info is not None and info.dtype else "uint32").newbyteorder("<")


def _chunk_bytes(token_bytes: int, itemsize: int) -> int:
    """Bytes per checksum chunk: 1/CHUNKS of the region, a whole number of tokens."""
    if not token_bytes:
        return 0
    per = -(-token_bytes // CHUNKS)
    return -(-per // itemsize) * itemsize


def _chunk_sums(tokens: bytes | memoryview, chunk: int) -> list[int]:
    view = memoryview(tokens)
    sums = [xxhash.xxh3_64_intdigest(view[a : a + chunk]) for a in range(0, len(view), chunk or 1)]
    return sums + [0] * (CHUNKS - len(sums))


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


class TokenShardWriter:
    """Buffers one shard (records and tokens) and writes it on close.

    The token region precedes the records and its size is known only at the end, so the whole
    shard is held until then: at most the shard size pack plans (``--shard-size``).
    """

    def __init__(self, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]):
        self._sink = CompressedSink(fileobj, compression)
        self._stream = stream_field(fields)
        self._dtype = _dtype(fields.get(self._stream) if self._stream else None)
        self._records: list[bytes] = []
        self._tokens: list[bytes] = []
        self._record_bytes = self._token_bytes = 0
        self._keys: list[str] = []
        self._offsets: list[int] = []  # in the records region; made absolute on close
        self._sizes: list[int] = []
        self._lengths: list[int] = []
        self._sums: list[int] = []

    def add(self, key: str, fields: Mapping[str, bytes], length: int | None = None) -> None:
        raw_key = _encode(key)
        if not raw_key or len(raw_key) > _MAX_KEY or len(fields) > _MAX_FIELDS:
            raise ShardError(
                f"sample {key!r}: a token shard holds keys of 1..{_MAX_KEY} bytes and at most "
                f"{_MAX_FIELDS} fields"
            )
        parts = [_U16.pack(len(raw_key)), raw_key, bytes([len(fields)])]
        tokens = b""
        for name in sorted(fields):
            data = fields[name]
            raw_name = name.encode()
            if not raw_name or len(raw_name) > _MAX_NAME:
                raise ShardError(f"sample {key!r}: field name {name!r} is empty or too long")
            parts += [bytes([len(raw_name)]), raw_name, _U64.pack(len(data))]
            if name == self._stream:
                if len(data) % self._dtype.itemsize:
                    raise ShardError(
                        f"sample {key!r}: field {name!r} holds {len(data)} bytes, not a whole "
                        f"number of {self._dtype.name} tokens"
                    )
                tokens = bytes(data)
            else:
                parts.append(bytes(data))
        record = b"".join(parts)
        digest = xxhash.xxh3_64_intdigest(record)
        if tokens:
            digest = xxhash.xxh3_64_intdigest(tokens, seed=digest)
            self._tokens.append(tokens)
        self._keys.append(key)
        self._offsets.append(self._record_bytes)
        self._sizes.append(len(record) + len(tokens))
        if self._stream is not None:
            length = len(tokens) // self._dtype.itemsize
        self._lengths.append(-1 if length is None else length)
        self._sums.append(digest)
        self._records.append(record)
        self._record_bytes += len(record)
        self._token_bytes += len(tokens)

    def close(self) -> WrittenShard:
        tokens = b"".join(self._tokens)
        self._tokens = []
        itemsize = self._dtype.itemsize if self._stream else 0
        chunk = _chunk_bytes(len(tokens), max(itemsize, 1))
        name = _encode(self._stream or "")
        head = _HEAD.pack(
            MAGIC,
            VERSION,
            itemsize,
            1 if self._dtype.kind == "i" and self._stream else 0,
            len(name),
            len(self._keys),
            len(tokens),
            self._record_bytes,
            chunk,
        )
        self._sink.write(head + name.ljust(_NAME_BYTES, b"\0"))
        self._sink.write(struct.pack(f"<{CHUNKS}Q", *_chunk_sums(tokens, chunk)))
        self._sink.write(tokens)
        del tokens
        group: list[bytes] = []
        pending = 0
        for record in self._records:  # a few large writes instead of one per record
            group.append(record)
            pending += len(record)
            if pending >= CHUNK:
                self._sink.write(b"".join(group))
                group, pending = [], 0
        self._sink.write(b"".join(group))
        self._records = []
        self._sink.close()
        base = HEADER_BYTES + self._token_bytes
        has_lengths = bool(self._lengths) and min(self._lengths) >= 0
        index = SampleIndex(
            keys=self._keys,
            offsets=np.asarray(self._offsets, np.int64) + base,
            sizes=np.asarray(self._sizes, np.int64),
            lengths=np.asarray(self._lengths, np.int64) if has_lengths else None,
            checksums=np.asarray(self._sums, np.uint64),
        )
        return WrittenShard(
            num_samples=len(self._keys),
            bytes=self._sink.stored.count,
            raw_bytes=base + self._record_bytes,
            sha256=self._sink.stored.sha.hexdigest(),
            index=index,
        )


# -- the header -------------------------------------------------------------------------------


class Header:
    """The parsed, checked header of a token shard."""

    def __init__(self, data: bytes, where: str) -> None:
        if len(data) < HEADER_BYTES:
            raise ShardError(f"{where}: truncated token shard ({len(data)} header bytes)")
        magic, version, itemsize, signed, name_len, n, tokens, records, chunk = _HEAD.unpack_from(
            data
        )
        if magic != MAGIC:
            raise ShardError(f"{where}: not a shardloader token shard (bad magic {magic!r})")
        if version != VERSION:
            raise ShardError(f"{where}: token shard version {version}, this reader knows {VERSION}")
        if (
            itemsize not in (0, 1, 2, 4, 8)
            or name_len > _NAME_BYTES
            or (itemsize == 0) != (name_len == 0)
        ):
            raise ShardError(f"{where}: corrupt token shard header (dtype or field name)")
        if itemsize and (tokens % itemsize or chunk != _chunk_bytes(tokens, itemsize)):
            raise ShardError(f"{where}: corrupt token shard header (token region {tokens:,})")
        if not itemsize and tokens:
            raise ShardError(f"{where}: corrupt token shard header (tokens without a field)")
        self.num_samples, self.token_bytes, self.record_bytes = n, tokens, records
        self.itemsize, self.chunk = itemsize, chunk
        self.dtype = np.dtype(f"<{'i' if signed else 'u'}{itemsize or 1}")
        raw_name = data[_HEAD.size : _HEAD.size + name_len]
        self.field = raw_name.decode("utf-8", "surrogateescape") if name_len else None
        self.sums = struct.unpack_from(f"<{CHUNKS}Q", data, _HEAD.size + _NAME_BYTES)
        self.records_at = HEADER_BYTES + tokens
        self.total = self.records_at + records

    @property
    def num_tokens(self) -> int:
        return self.token_bytes // self.itemsize if self.itemsize else 0

    def check_chunk(self, region: bytes | memoryview, c: int, where: str) -> None:
        """ChecksumError unless chunk ``c`` of ``region`` (the token region) matches its sum."""
        a = c * self.chunk
        got = xxhash.xxh3_64_intdigest(region[a : a + self.chunk])
        if got != self.sums[c]:
            lo, hi = a // self.itemsize, min(a + self.chunk, self.token_bytes) // self.itemsize
            raise ChecksumError(
                f"{where}: tokens {lo:,}..{hi:,} (chunk {c} of the token region) have checksum "
                f"{got:016x}, the shard's table says {self.sums[c]:016x}: the shard is damaged; "
                "`shardloader verify` checks the whole dataset (ReadOptions(verify_samples="
                "False) skips this check)"
            )


def _record(
    buf: Any, pos: int, end: int, stream: str | None, where: str
) -> tuple[str, list[tuple[str, int, int]], int]:
    """Parse one record at ``pos`` (not past ``end``): key, [(field, data offset or -1 for the
    token field, size)], end of the record."""

    def need(n: int) -> None:
        if pos + n > end:
            raise ShardError(f"{where}: truncated record at byte {pos:,}")

    need(3)
    (key_len,) = _U16.unpack_from(buf, pos)
    pos += 2
    need(key_len + 1)
    key = bytes(buf[pos : pos + key_len]).decode("utf-8", "surrogateescape")
    pos += key_len
    count = buf[pos]
    pos += 1
    fields = []
    for _ in range(count):
        need(1)
        name_len = buf[pos]
        need(1 + name_len + 8)
        name = bytes(buf[pos + 1 : pos + 1 + name_len]).decode("utf-8", "surrogateescape")
        (size,) = _U64.unpack_from(buf, pos + 1 + name_len)
        pos += 1 + name_len + 8
        if name == stream:
            fields.append((name, -1, size))
            continue
        need(size)
        fields.append((name, pos, size))
        pos += size
    return key, fields, pos


class TokenStream:
    """The token region of a local uncompressed token shard, memory-mapped: :attr:`tokens` is
    a read-only array of every token of the shard; :meth:`check_tokens` checks the chunks a
    token range touches against the shard's table, each chunk once per stream."""

    def __init__(self, local_path: str, where: str, verify: bool = True) -> None:
        self.where = where
        self._map: Any = b""
        with open(local_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            head = Header(bytes(self._map[:HEADER_BYTES]), where)
            if head.total != size:
                raise ShardError(
                    f"{where}: truncated or padded token shard: {size:,} bytes, its header "
                    f"says {head.total:,}"
                )
        except BaseException:
            self.close()
            raise
        self.header = head
        self.view = memoryview(self._map)
        self.verify = verify
        self._checked = np.zeros(CHUNKS, bool)
        self.all_checked = not verify or not head.chunk  # every chunk checked: skip the calls
        self.tokens = np.frombuffer(
            self._map, head.dtype, head.num_tokens, HEADER_BYTES if head.num_tokens else 0
        )

    def expect(self, num_samples: int, num_tokens: int | None) -> None:
        """ShardError unless the shard holds ``num_samples`` samples and, when it streams a
        field, ``num_tokens`` tokens (what its sidecar says)."""
        head = self.header
        if head.num_samples != num_samples:
            raise ShardError(
                f"{self.where}: the token shard holds {head.num_samples} samples, its sidecar "
                f"lists {num_samples}: the shard and its .idx.arrow sidecar do not match"
            )
        if head.field is not None and num_tokens != head.num_tokens:
            raise ShardError(
                f"{self.where}: the token shard holds {head.num_tokens:,} tokens, its "
                f"sidecar's lengths add up to {num_tokens}: the shard and its .idx.arrow "
                "sidecar do not match"
            )

    def check_tokens(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """Check the chunks holding tokens ``lo[i]..hi[i]`` (arrays of token ranges) against
        the table, each chunk once per stream."""
        head = self.header
        if self.all_checked:
            return
        keep = hi > lo
        first = lo[keep] * head.itemsize // head.chunk
        count = (hi[keep] * head.itemsize - 1) // head.chunk - first + 1
        total = int(count.sum())
        if not total:
            return
        skip = np.repeat(first - np.cumsum(count) + count, count)
        chunks = np.unique(np.arange(total, dtype=np.int64) + skip)
        todo = chunks[~self._checked[chunks]]
        if not todo.size:
            return
        region = self.view[HEADER_BYTES : HEADER_BYTES + head.token_bytes]
        for c in todo.tolist():
            head.check_chunk(region, c, self.where)
            self._checked[c] = True
        self.all_checked = bool(self._checked[: -(-head.token_bytes // head.chunk)].all())

    def close(self) -> None:
        tokens = getattr(self, "tokens", None)
        if tokens is not None:
            self.tokens = np.zeros(0, tokens.dtype)
        view = getattr(self, "view", None)
        if view is not None:
            view.release()
        if isinstance(self._map, mmap.mmap):
            try:
                self._map.close()
            except BufferError:  # a token array someone still holds: the GC unmaps it
                pass


class TokenShardReader:
    """Samples of a local uncompressed token shard, by sidecar entry: ``read(i)`` parses the
    record the sidecar points at and checks its checksum (``verify``)."""

    def __init__(
        self, local_path: str, index: SampleIndex, where: str, verify: bool = True
    ) -> None:
        self._where = where
        self.stream = TokenStream(local_path, where, verify)
        try:
            lengths = index.lengths
            self.stream.expect(len(index), int(lengths.sum()) if lengths is not None else None)
        except BaseException:
            self.stream.close()
            raise
        self.header = self.stream.header
        self._view = self.stream.view
        self._index = index
        self._offsets = index.offsets.tolist()
        self._sums = index.checksums.tolist() if verify and index.checksums is not None else None
        self._token_at: list[int] | None = None  # token start of each sample, made on demand

    @property
    def tokens(self) -> np.ndarray:
        return self.stream.tokens

    def read(self, i: int) -> Sample:
        head, key_of = self.header, self._index.keys[i]
        pos = self._offsets[i]
        if not head.records_at <= pos < head.total:
            raise ShardError(f"{self._where}: sample {key_of!r}: offset {pos:,} is outside")
        key, fields, end = _record(self._view, pos, head.total, head.field, self._where)
        if key != key_of:
            raise ShardError(
                f"{self._where}: sample index says {key_of!r} at byte {pos:,}, found {key!r}; "
                "the shard and its .idx.arrow sidecar do not match"
            )
        if self._token_at is None:
            starts = [0]
            lengths = self._index.lengths
            if lengths is not None and head.field is not None:
                starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
            else:
                starts = [0] * (len(self._index) + 1)
            self._token_at = starts
        t0, t1 = self._token_at[i] * head.itemsize, self._token_at[i + 1] * head.itemsize
        tokens = self._view[HEADER_BYTES + t0 : HEADER_BYTES + t1]
        if self._sums is not None:
            digest = xxhash.xxh3_64_intdigest(self._view[pos:end])
            if t1 > t0:
                digest = xxhash.xxh3_64_intdigest(tokens, seed=digest)
            if digest != self._sums[i]:
                raise ChecksumError(
                    f"{self._where}: sample {key!r} (bytes {pos}..{end}, tokens {t0}..{t1}) "
                    f"has checksum {digest:016x}, its sidecar says {self._sums[i]:016x}: the "
                    "shard is damaged; `shardloader verify` checks the whole dataset "
                    "(ReadOptions(verify_samples=False) skips this per-sample check)"
                )
        out: dict[str, bytes] = {}
        for name, at, size in fields:
            if at < 0:
                if size != t1 - t0:
                    raise ShardError(
                        f"{self._where}: sample {key!r}: its record says {size} token bytes, "
                        f"its sidecar length {t1 - t0}: the shard and its sidecar do not match"
                    )
                out[name] = bytes(tokens)
            else:
                out[name] = self._view[at : at + size].tobytes()
        return key, out

    def close(self) -> None:
        self.stream.close()


# -- streaming a stored shard (verify) --------------------------------------------------------


class _Input:
    """Exact reads from a (decompressed) stream, never more than ``limit`` bytes in all."""

    def __init__(self, stream: BinaryIO, where: str, limit: int | None) -> None:
        self._stream, self._where, self._limit = stream, where, limit
        self._buf = b""
        self._pos = 0
        self.count = 0

    def read(self, n: int, what: str) -> bytes:
        if self._limit is not None and self.count + n > self._limit:
            raise too_big(self._where, what, self._limit, "the manifest declares (raw_bytes)")
        parts = [self._buf[self._pos : self._pos + n]]
        got = len(parts[0])
        self._pos += got
        while got < n:
            chunk = self._stream.read(max(CHUNK, n - got))
            if not chunk:
                raise ShardError(f"{self._where}: truncated token shard (in {what})")
            take = chunk[: n - got]
            parts.append(take)
            got += len(take)
            self._buf, self._pos = chunk, len(take)
        self.count += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def at_end(self) -> bool:
        return self._pos >= len(self._buf) and not self._stream.read(1)


def iter_tokens(
    src: BinaryIO,
    compression: str,
    where: str,
    limit: int | None = None,
    max_member: int | None = None,
) -> Iterator[Sample]:
    """Every sample of a stored token shard, front to back; the token region is held (it is
    read first) and checked against its table.  Bounded by ``limit`` and ``max_member``."""
    try:
        data = _Input(decompressed(src, compression), where, limit)
        head = Header(data.read(HEADER_BYTES, "the header"), where)
        if limit is not None and head.total > limit:
            raise too_big(where, "the header's declared size", limit, "the manifest declares")
        region = data.read(head.token_bytes, "the token region")
        for c in range(-(-head.token_bytes // head.chunk) if head.chunk else 0):
            head.check_chunk(region, c, where)
        cursor = 0
        for _ in range(head.num_samples):
            sample, used = _next_record(data, head, region, cursor, where, max_member)
            cursor += used
            yield sample
        if cursor != head.token_bytes or data.count != head.total or not data.at_end():
            raise ShardError(
                f"{where}: the token shard's records do not add up to its header (tokens "
                f"{cursor:,} of {head.token_bytes:,}, or bytes after the last record)"
            )
    except DECOMPRESS_ERRORS as err:
        if isinstance(err, ShardError):
            raise
        raise ShardError(f"{where}: cannot decompress shard ({err})") from err


def _next_record(
    data: _Input, head: Header, region: bytes, cursor: int, where: str, max_member: int | None
) -> tuple[Sample, int]:
    """The next record of the stream with its tokens from ``region`` at ``cursor``, and the
    token bytes it took."""
    (key_len,) = _U16.unpack(data.read(2, "a record"))
    key = data.read(key_len, "a record").decode("utf-8", "surrogateescape")
    problem = unsafe_key_reason(key)
    if problem is not None:
        raise unsafe_key_error(where, key, problem)
    fields: dict[str, bytes] = {}
    used = 0
    for _ in range(data.read(1, "a record")[0]):
        name = data.read(data.read(1, "a record")[0], "a record").decode("utf-8", "replace")
        (size,) = _U64.unpack(data.read(8, "a record"))
        if max_member is not None and size > max_member:
            raise ShardError(
                f"{where}: field {name!r} of sample {key!r} has {size:,} bytes, more than the "
                f"{max_member:,} allowed for one sample; the shard is corrupt or hostile"
            )
        if name == head.field:
            if cursor + used + size > head.token_bytes or size % head.itemsize:
                raise ShardError(f"{where}: sample {key!r} claims tokens past the token region")
            fields[name] = region[cursor + used : cursor + used + size]
            used += size
        else:
            fields[name] = data.read(size, f"field {name!r} of sample {key!r}")
    return (key, fields), used


class TokenFormat(Format):
    """Token shards: a contiguous token region per shard plus one record per sample."""

    name = "tokens"
    suffixes = {"zstd": ".tok.zst", "gzip": ".tok.gz", "none": ".tok"}
    min_sample_bytes = 4  # key length, a one-byte key, a field count
    end_bytes = HEADER_BYTES  # not after the samples but before them: the same for the checks
    shard_overhead = HEADER_BYTES
    stored_is_raw = True

    def writer(
        self, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]
    ) -> TokenShardWriter:
        return TokenShardWriter(fileobj, compression, fields)

    def sample_raw_size(self, key: str, sizes: Sequence[tuple[str, int]]) -> int:
        framing = sum(1 + len(ext.encode()) + 8 for ext, _ in sizes)
        return 3 + len(_encode(key)) + framing + sum(size for _, size in sizes)

    def reader(
        self, local_path: str, index: SampleIndex, where: str, verify: bool = True
    ) -> TokenShardReader:
        return TokenShardReader(local_path, index, where, verify)

    def stage(
        self,
        src: BinaryIO,
        dst: BinaryIO,
        compression: str,
        where: str,
        limit: int | None = None,
    ) -> int:
        return stage_stream(src, dst, compression, where, limit)

    def iter_stored(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        limit: int | None = None,
        max_member: int | None = None,
    ) -> Iterator[Sample]:
        return iter_tokens(src, compression, where, limit, max_member)

    def entry_problem(
        self, num_samples: int, stored: int, raw: int, compression: str
    ) -> tuple[str, str] | None:
        if raw < HEADER_BYTES:
            return "raw_bytes", f"{raw:,} is less than a token shard's {HEADER_BYTES}-byte header"
        return super().entry_problem(num_samples, stored, raw, compression)

    def index_problem(self, index: SampleIndex, info: ShardInfo) -> str | None:
        """Records lie after the header, in order, and all samples fit ``raw_bytes``."""
        if not len(index):
            return None
        offsets, sizes = index.offsets, index.sizes
        bad = (offsets < HEADER_BYTES) | (offsets >= info.raw_bytes) | (sizes < 4)
        bad[1:] |= offsets[1:] < offsets[:-1] + 4
        if bad.any():
            i = int(bad.argmax())
            return (
                f"the sample index puts sample {index.keys[i]!r} at byte {int(offsets[i]):,}, "
                f"outside the records of the {info.raw_bytes:,}-byte token shard or out of "
                "order; the sidecar does not match the shard"
            )
        if int(sizes.sum()) > info.raw_bytes - HEADER_BYTES:
            return (
                f"the sample index declares {int(sizes.sum()):,} bytes of samples, more than "
                f"the {info.raw_bytes:,}-byte token shard holds"
            )
        return None


def check_token_field(fields: Mapping[str, FieldInfo]) -> None:
    """UsageError unless ``fields`` have a field this format streams (for the block planner)."""
    if stream_field(fields) is None:
        raise UsageError(
            "token shards stream one field of codec 'tokens' (pack text with --tokenizer); "
            f"fields here: {', '.join(fields) or 'none'}"
        )


FORMAT = register_format(TokenFormat())
