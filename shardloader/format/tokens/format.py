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

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import xxhash

from shardloader.errors import ShardError, located
from shardloader.format.base import CheckedFormat, Sample, WrittenShard
from shardloader.format.compress import CHUNK, CompressedSink
from shardloader.format.mapped import MappedFile
from shardloader.format.recorder import IndexRecorder
from shardloader.format.registry import register_format
from shardloader.format.rows import damaged
from shardloader.format.tokens.layout import (
    CHUNKS,
    HEADER_BYTES,
    MAX_FIELDS,
    MAX_KEY,
    MAX_NAME,
    TOKEN_FIELD,
    U16,
    U64,
    Header,
    encode,
    pack_header,
    parse_record,
    stream_field,
    token_dtype,
)
from shardloader.format.tokens.stream import iter_tokens
from shardloader.manifest import SampleIndex

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


class TokenShardWriter:
    """Buffers one shard (records and tokens) and writes it on close.

    The token region precedes the records and its size is known only at the end, so the whole
    shard is held until then: at most the shard size pack plans (``--shard-size``).
    """

    def __init__(self, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]):
        self._sink = CompressedSink(fileobj, compression)
        self._stream = stream_field(fields)
        self._dtype = token_dtype(fields.get(self._stream) if self._stream else None)
        self._records: list[bytes] = []
        self._tokens: list[bytes] = []
        self._record_bytes = self._token_bytes = 0
        self._index = IndexRecorder()  # offsets in the records region; made absolute on close

    def add(self, key: str, fields: Mapping[str, bytes], length: int | None = None) -> None:
        raw_key = encode(key)
        if not raw_key or len(raw_key) > MAX_KEY or len(fields) > MAX_FIELDS:
            raise ShardError(
                f"sample {key!r}: a token shard holds keys of 1..{MAX_KEY} bytes and at most "
                f"{MAX_FIELDS} fields"
            )
        parts = [U16.pack(len(raw_key)), raw_key, bytes([len(fields)])]
        tokens = b""
        for name in sorted(fields):
            data = fields[name]
            raw_name = name.encode()
            if not raw_name or len(raw_name) > MAX_NAME:
                raise ShardError(f"sample {key!r}: field name {name!r} is empty or too long")
            parts += [bytes([len(raw_name)]), raw_name, U64.pack(len(data))]
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
        if self._stream is not None:
            length = len(tokens) // self._dtype.itemsize
        self._index.add(key, self._record_bytes, len(record) + len(tokens), length, digest)
        self._records.append(record)
        self._record_bytes += len(record)
        self._token_bytes += len(tokens)

    def close(self) -> WrittenShard:
        tokens = b"".join(self._tokens)
        self._tokens = []
        field = self._stream
        self._sink.write(
            pack_header(field, self._dtype, len(self._index.keys), tokens, self._record_bytes)
        )
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
        index = self._index.index(base)
        return self._index.written(self._sink.stored, base + self._record_bytes, index)


class TokenStream:
    """The token region of a local uncompressed token shard, memory-mapped: :attr:`tokens` is
    a read-only array of every token of the shard; :meth:`check_tokens` checks the chunks a
    token range touches against the shard's table, each chunk once per stream.

    ``num_samples`` and ``num_tokens`` (what the sidecar says; None: not checked): a shard that
    holds another count of samples, or of tokens when it streams a field, is a ShardError.
    """

    def __init__(
        self,
        local_path: str,
        verify: bool = True,
        num_samples: int | None = None,
        num_tokens: int | None = None,
    ) -> None:
        self.file = MappedFile(local_path)  # also reads a large sample through the file
        self._map: Any = self.file.map
        try:
            head = Header(bytes(self._map[:HEADER_BYTES]))
            _expect(head, self.file.size, num_samples, num_tokens)
        except BaseException:
            self.close()
            raise
        self.header = head
        self.view = self.file.view
        self._checked = np.zeros(CHUNKS, bool)
        self.all_checked = not verify or not head.chunk  # every chunk checked: skip the calls
        self.tokens = np.frombuffer(
            self._map, head.dtype, head.num_tokens, HEADER_BYTES if head.num_tokens else 0
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
            head.check_chunk(region, c)
            self._checked[c] = True
        self.all_checked = bool(self._checked[: -(-head.token_bytes // head.chunk)].all())

    def close(self) -> None:
        tokens = getattr(self, "tokens", None)
        if tokens is not None:
            self.tokens = np.zeros(0, tokens.dtype)
        self.file.close()  # a token array someone still holds: the GC unmaps it


def _expect(head: Header, size: int, num_samples: int | None, num_tokens: int | None) -> None:
    """ShardError unless the file is as long as its header says and holds the samples and
    tokens its sidecar says (``TokenStream``)."""
    if head.total != size:
        raise ShardError(
            f"truncated or padded token shard: {size:,} bytes, its header says {head.total:,}"
        )
    if num_samples is not None and head.num_samples != num_samples:
        raise ShardError(
            f"the token shard holds {head.num_samples} samples, its sidecar lists "
            f"{num_samples}: the shard and its .idx.arrow sidecar do not match"
        )
    if num_samples is not None and head.field is not None and num_tokens != head.num_tokens:
        raise ShardError(
            f"the token shard holds {head.num_tokens:,} tokens, its sidecar's lengths add up "
            f"to {num_tokens}: the shard and its .idx.arrow sidecar do not match"
        )


class TokenShardReader(TokenStream):
    """Samples of a local uncompressed token shard, by sidecar entry: ``read(i)`` parses the
    record the sidecar points at and checks its checksum (``verify``)."""

    def __init__(self, local_path: str, index: SampleIndex, verify: bool = True) -> None:
        tokens = None if index.lengths is None else int(index.lengths.sum())
        super().__init__(local_path, verify, len(index), tokens)
        self._index = index
        self._offsets = index.offsets.tolist()
        self._sums = index.checksums.tolist() if verify and index.checksums is not None else None
        lengths = index.lengths if index.lengths is not None and self.header.field else None
        starts = np.cumsum(lengths) if lengths is not None else np.zeros(len(index), np.int64)
        self._token_at = [0, *starts.tolist()]  # token start of each sample

    @property
    def keys(self) -> Sequence[str]:
        """The sidecar's keys (a sample that fails to read is still named by its key)."""
        return self._index.keys

    def read(self, i: int) -> Sample:
        head, key_of = self.header, self._index.keys[i]
        pos = self._offsets[i]
        if not head.records_at <= pos < head.total:
            raise ShardError(f"sample {key_of!r}: offset {pos:,} is outside")
        key, fields, end = parse_record(self.view, pos, head.total, head.field)
        if key != key_of:
            raise ShardError(
                f"sample index says {key_of!r} at byte {pos:,}, found {key!r}; "
                "the shard and its .idx.arrow sidecar do not match"
            )
        t0, t1 = self._token_at[i] * head.itemsize, self._token_at[i + 1] * head.itemsize
        file = self.file
        if self._sums is not None:
            digest = file.digest(pos, end)
            if t1 > t0:
                digest = file.digest(HEADER_BYTES + t0, HEADER_BYTES + t1, seed=digest)
            if digest != self._sums[i]:
                raise damaged(
                    f"sample {key!r} (bytes {pos}..{end}, tokens {t0}..{t1}) "
                    f"has checksum {digest:016x}, its sidecar says {self._sums[i]:016x}"
                )
        out: dict[str, bytes] = {}
        for name, at, size in fields:
            if at < 0:
                if size != t1 - t0:
                    raise ShardError(
                        f"sample {key!r}: its record says {size} token bytes, "
                        f"its sidecar length {t1 - t0}: the shard and its sidecar do not match"
                    )
                out[name] = file.copy(HEADER_BYTES + t0, HEADER_BYTES + t1)
            else:
                out[name] = file.copy(at, at + size)
        return key, out


class TokenFormat(CheckedFormat):
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
        return 3 + len(encode(key)) + framing + sum(size for _, size in sizes)

    def reader(self, local_path: str, index: SampleIndex, verify: bool = True) -> TokenShardReader:
        return TokenShardReader(local_path, index, verify)

    def iter_checked(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        index: SampleIndex | None,
        limit: int | None = None,
        max_member: int | None = None,
    ) -> Iterator[tuple[Sample, int | None]]:
        """Each sample with the XXH3-64 of its record and tokens, as the reader computes it."""
        with located(where):
            yield from iter_tokens(src, compression, limit, max_member)

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


FORMAT = register_format(TokenFormat())
