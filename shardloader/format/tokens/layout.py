"""The layout of a token shard (``format/tokens/format.py``): its constants, header and record
framing, shared by the writer, the readers and the stream (``format/tokens/stream.py``)."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from shardloader.errors import ChecksumError, ShardError

if TYPE_CHECKING:
    from shardloader.manifest import FieldInfo

__all__ = [
    "CHUNKS",
    "HEADER_BYTES",
    "MAGIC",
    "TOKEN_FIELD",
    "VERSION",
    "Header",
    "chunk_bytes",
    "chunk_sums",
    "encode",
    "pack_header",
    "parse_record",
    "stream_field",
    "token_dtype",
]

MAGIC = b"SLTOKENS"
VERSION = 1
TOKEN_FIELD = "tokens"  # the field pack --tokenizer adds; preferred when several are tokens
CHUNKS = 1008  # token-region checksums per shard: a fixed table keeps sizes additive
_HEAD = struct.Struct("<8sHBBB3xQQQQ16x")  # 64 bytes; then 64 bytes of field name
_NAME_BYTES = 64
HEADER_BYTES = _HEAD.size + _NAME_BYTES + 8 * CHUNKS  # 8192: the token region is page-aligned
U16, U64 = struct.Struct("<H"), struct.Struct("<Q")
MAX_KEY, MAX_NAME, MAX_FIELDS = 0xFFFF, 0xFF, 0xFF


def stream_field(fields: Mapping[str, FieldInfo]) -> str | None:
    """The field whose bytes go to the token region: the only ``tokens``-codec field, or the
    one named ``tokens`` among several; None when there is none (every field is a record)."""
    names = sorted(n for n, info in fields.items() if info.codec == "tokens")
    if len(names) > 1:
        names = [n for n in names if n == TOKEN_FIELD]
    if len(names) != 1 or len(names[0].encode()) > _NAME_BYTES:
        return None
    return names[0]


def token_dtype(info: FieldInfo | None) -> np.dtype:
    return np.dtype(info.dtype if info is not None and info.dtype else "uint32").newbyteorder("<")


def chunk_bytes(token_bytes: int, itemsize: int) -> int:
    """Bytes per checksum chunk: 1/CHUNKS of the region, a whole number of tokens."""
    if not token_bytes:
        return 0
    per = -(-token_bytes // CHUNKS)
    return -(-per // itemsize) * itemsize


def chunk_sums(tokens: bytes | memoryview, chunk: int) -> list[int]:
    view = memoryview(tokens)
    sums = [xxhash.xxh3_64_intdigest(view[a : a + chunk]) for a in range(0, len(view), chunk or 1)]
    return sums + [0] * (CHUNKS - len(sums))


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


# -- the header -------------------------------------------------------------------------------


def pack_header(
    field: str | None, dtype: np.dtype, num_samples: int, tokens: bytes, record_bytes: int
) -> bytes:
    """Header, field name and chunk table of a shard whose token region is ``tokens``."""
    itemsize = dtype.itemsize if field else 0
    chunk = chunk_bytes(len(tokens), max(itemsize, 1))
    name = encode(field or "")
    head = _HEAD.pack(
        MAGIC,
        VERSION,
        itemsize,
        1 if dtype.kind == "i" and field else 0,
        len(name),
        num_samples,
        len(tokens),
        record_bytes,
        chunk,
    )
    table = struct.pack(f"<{CHUNKS}Q", *chunk_sums(tokens, chunk))
    return head + name.ljust(_NAME_BYTES, b"\0") + table


class Header:
    """The parsed, checked header of a token shard."""

    def __init__(self, data: bytes) -> None:
        if len(data) < HEADER_BYTES:
            raise ShardError(f"truncated token shard ({len(data)} header bytes)")
        magic, version, itemsize, signed, name_len, n, tokens, records, chunk = _HEAD.unpack_from(
            data
        )
        if magic != MAGIC:
            raise ShardError(f"not a shardloader token shard (bad magic {magic!r})")
        if version != VERSION:
            raise ShardError(f"token shard version {version}, this reader knows {VERSION}")
        if (
            itemsize not in (0, 1, 2, 4, 8)
            or name_len > _NAME_BYTES
            or (itemsize == 0) != (name_len == 0)
        ):
            raise ShardError("corrupt token shard header (dtype or field name)")
        if itemsize and (tokens % itemsize or chunk != chunk_bytes(tokens, itemsize)):
            raise ShardError(f"corrupt token shard header (token region {tokens:,})")
        if not itemsize and tokens:
            raise ShardError("corrupt token shard header (tokens without a field)")
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

    def check_chunk(self, region: bytes | memoryview, c: int) -> None:
        """ChecksumError unless chunk ``c`` of ``region`` (the token region) matches its sum."""
        a = c * self.chunk
        got = xxhash.xxh3_64_intdigest(region[a : a + self.chunk])
        if got != self.sums[c]:
            lo, hi = a // self.itemsize, min(a + self.chunk, self.token_bytes) // self.itemsize
            raise ChecksumError(
                f"tokens {lo:,}..{hi:,} (chunk {c} of the token region) have checksum "
                f"{got:016x}, the shard's table says {self.sums[c]:016x}: the shard is damaged; "
                "`shardloader verify` checks the whole dataset (ReadOptions(verify_samples="
                "False) skips this check)"
            )


def parse_record(
    buf: Any, pos: int, end: int, stream: str | None
) -> tuple[str, list[tuple[str, int, int]], int]:
    """Parse one record at ``pos`` (not past ``end``): key, [(field, data offset or -1 for the
    token field, size)], end of the record."""

    def need(n: int) -> None:
        if pos + n > end:
            raise ShardError(f"truncated record at byte {pos:,}")

    need(3)
    (key_len,) = U16.unpack_from(buf, pos)
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
        (size,) = U64.unpack_from(buf, pos + 1 + name_len)
        pos += 1 + name_len + 8
        if name == stream:
            fields.append((name, -1, size))
            continue
        need(size)
        fields.append((name, pos, size))
        pos += size
    return key, fields, pos
