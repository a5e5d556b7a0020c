"""Whole-stream compression of a stored shard, and bounded decompression of one.

Tar shards are compressed as a whole (``.tar.zst``, ``.tar.gz``); a format whose shards are a
plain byte stream can reuse these pieces: :class:`CompressedSink` to write, :func:`decompressed`
to stream back (read through :class:`Bounded`, inside :func:`decompressing`), :func:`stage_stream`
to stage with a bound.  Errors here do not name the shard: the format's entry point does, once
(``shardloader.errors.located``).
"""

from __future__ import annotations

import gzip
import hashlib
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

import zstandard

from shardloader.errors import ShardError, ShardloaderError, UsageError

__all__ = [
    "CHUNK",
    "DECOMPRESS_ERRORS",
    "RAW_REASON",
    "Bounded",
    "CompressedSink",
    "HashingCounter",
    "cannot_decompress",
    "check_size",
    "decompressed",
    "decompressing",
    "stage_stream",
    "too_big",
]

CHUNK = 1 << 20
ZSTD_LEVEL = 3
GZIP_LEVEL = 6
# What a corrupt compressed stream raises while being read.  Shardloader's own errors are
# OSErrors too (a StorageError of the source, a ShardError): callers re-raise those unchanged,
# so a spent retry budget reaches the user as the StorageError it is (cannot_decompress).
DECOMPRESS_ERRORS: tuple[type[BaseException], ...] = (
    zstandard.ZstdError,
    zlib.error,  # a damaged gzip stream's deflate data
    OSError,
    EOFError,
)
RAW_REASON = "the manifest declares (raw_bytes)"


class HashingCounter:
    """File wrapper that hashes and counts the stored bytes on their way to disk."""

    def __init__(self, fileobj: BinaryIO) -> None:
        self._f = fileobj
        self.sha = hashlib.sha256()
        self.count = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.count += view.nbytes
        return self._f.write(view)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:  # the caller owns the file: closing the wrapper only flushes
        self._f.flush()

    @property
    def closed(self) -> bool:
        return False


class CompressedSink:
    """Writes a stream through zstd, gzip or no compression; ``stored`` counts and hashes the
    compressed bytes.  Same input, same bytes (gzip without a name or mtime)."""

    def __init__(self, fileobj: BinaryIO, compression: str) -> None:
        self.stored = HashingCounter(fileobj)
        self._compressor: object | None
        if compression == "zstd":
            cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
            self._compressor = cctx.stream_writer(self.stored, closefd=False)  # type: ignore[arg-type]
        elif compression == "gzip":
            self._compressor = gzip.GzipFile(
                filename="",
                mode="wb",
                fileobj=self.stored,
                mtime=0,  # type: ignore[arg-type]
                compresslevel=GZIP_LEVEL,
            )
        elif compression == "none":
            self._compressor = None
        else:
            raise UsageError(f"unknown compression {compression!r}; choose zstd, gzip or none")
        self._sink = self._compressor if self._compressor is not None else self.stored

    def write(self, data: bytes | bytearray) -> int:
        return self._sink.write(data)  # type: ignore[attr-defined,no-any-return,arg-type]

    def close(self) -> None:
        """Finish the compressed stream and flush it (the file itself stays open)."""
        if self._compressor is not None:
            self._compressor.close()  # type: ignore[attr-defined]
        self.stored.flush()


_SKIPPABLE = 0x184D2A50  # to 0x184D2A5F: a skippable frame (the tar index rides in one)


class _ZstdFrames:
    """The compressed stream on its way into zstd's reader, its frames followed from their
    headers (a few per 128 KiB block): zstd's reader ends quietly where its source ends, even
    inside a frame, so this source raises there instead."""

    def __init__(self, src: BinaryIO) -> None:
        self._src = src
        self._head = b""  # the bytes of the header being read
        self._need = 4  # bytes that header takes
        self._state = "magic"
        self._skip = 0  # bytes of block data (or a skippable frame) still to pass
        self._checksum = False

    def read(self, n: int) -> bytes:
        data = self._src.read(n)
        if not data and (self._state != "magic" or self._head or self._skip):
            raise ShardError("truncated shard: the zstd stream ends inside a frame")
        at, size = 0, len(data)
        while at < size:
            if self._skip:
                step = min(self._skip, size - at)
                self._skip -= step
                at += step
                continue
            step = min(self._need - len(self._head), size - at)
            self._head += bytes(data[at : at + step])
            at += step
            if len(self._head) == self._need:
                self._parse(self._head)
        return data

    def _parse(self, head: bytes) -> None:
        """Take the header ``head`` of the current state; set the next state."""
        value = int.from_bytes(head, "little")
        state, self._head, self._need = self._state, b"", 3
        if state == "magic" and value & ~0xF == _SKIPPABLE:
            self._state, self._need = "skippable", 4
        elif state == "magic":  # zstd's reader refuses anything but a frame itself
            self._state, self._need = "descriptor", 1
        elif state == "skippable":
            self._state, self._need, self._skip = "magic", 4, value
        elif state == "descriptor":  # window, dictionary id and content size fields
            single, dict_flag, size_flag = value >> 5 & 1, value & 3, value >> 6
            self._checksum = bool(value & 4)
            self._skip = (1 - single) + (0, 1, 2, 4)[dict_flag]
            self._skip += (single, 2, 4, 8)[size_flag]
            self._state = "block"
        elif state == "block":  # last-block bit, type, size: RLE blocks store one byte
            kind, size = value >> 1 & 3, value >> 3
            self._skip = 1 if kind == 1 else size
            if value & 1:  # the frame's last block, then its checksum, if it has one
                self._skip += 4 * self._checksum
                self._state, self._need = "magic", 4


def decompressed(src: BinaryIO, compression: str) -> BinaryIO:
    """``src`` (a stored shard) read through its compression; a stream cut short raises
    (ShardError, or gzip's EOFError: :func:`decompressing`) where it ends."""
    if compression == "zstd":  # reads the source a CHUNK at a time: what stores hand out
        return zstandard.ZstdDecompressor().stream_reader(  # type: ignore[return-value]
            _ZstdFrames(src),  # type: ignore[arg-type]
            read_size=CHUNK,
            read_across_frames=True,
        )
    if compression == "gzip":
        return gzip.GzipFile(fileobj=src, mode="rb")  # type: ignore[return-value]
    if compression == "none":
        return src
    raise UsageError(f"unknown compression {compression!r}; choose zstd, gzip or none")


def cannot_decompress(err: BaseException) -> ShardError:
    """The error for a stored shard that its compression cannot read (``err``: zstd's or
    gzip's, never shardloader's own, which callers re-raise unchanged).

    A frame written with a long window (``zstd --long=31``, more than zstd's default 128 MiB)
    is refused with the remedy: re-compress it without ``--long``, as pack writes shards.
    """
    text = str(err)
    if "too much memory" in text or "window" in text.lower():
        return ShardError(
            f"cannot decompress shard ({text}): it was compressed with a window larger "
            "than the 128 MiB zstd decodes by default (`zstd --long=31`?); shardloader does "
            "not read such frames: re-compress it with `zstd -d --long=31 -c FILE | zstd -o "
            "NEW`, or re-pack the source with `shardloader pack`"
        )
    return ShardError(
        f"cannot decompress shard ({text}); `shardloader verify` tells whether the "
        "stored shard itself is damaged: if so, re-pack it or restore it from a copy"
    )


@contextmanager
def decompressing() -> Iterator[None]:
    """A compressed stream's errors inside as :func:`cannot_decompress`; shardloader's own
    (the source's StorageError, a ShardError) pass unchanged, so a spent retry budget reaches
    the user as the StorageError it is."""
    try:
        yield
    except DECOMPRESS_ERRORS as err:
        if isinstance(err, ShardloaderError):
            raise
        raise cannot_decompress(err) from err


def too_big(what: str, limit: int, reason: str = RAW_REASON) -> ShardError:
    return ShardError(
        f"{what} goes past the {limit:,} bytes {reason}; the shard is corrupt or "
        "hostile (a decompression bomb?): re-pack it or restore it from a copy"
    )


def check_size(
    what: str,
    size: int,
    max_member: int | None,
    remedy: str = "the shard is corrupt or hostile (a decompression bomb?)",
) -> None:
    """ShardError when ``what`` (a member, a field) of ``size`` bytes passes ``max_member``,
    the most one sample's field may take; ``remedy`` says what to do about it."""
    if max_member is not None and size > max_member:
        raise ShardError(
            f"{what} declares {size:,} bytes, more than the {max_member:,} allowed for one "
            f"sample; {remedy}"
        )


class Bounded:
    """A (decompressed) stream read front to back, never past ``limit`` bytes (NOTE [bounded
    formats] in format/base.py): a read is checked against it before anything is read.

    Reads come out of a buffer refilled a :data:`CHUNK` at a time, so the many small reads of
    headers and records cost no call into the decompressor each.  ``pos`` counts the bytes
    read; ``on_data`` (when set) sees each of them, in order (checksums).
    """

    def __init__(
        self,
        f: BinaryIO,
        limit: int | None = None,
        reason: str = RAW_REASON,
        on_data: Callable[[bytes], object] | None = None,
    ) -> None:
        self._f, self.limit, self.reason, self.on_data = f, limit, reason, on_data
        self._buf, self._at = b"", 0
        self.pos = 0

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes: fewer only where the stream ends."""
        parts = [self._buf[self._at : self._at + n]]
        got = len(parts[0])
        self._at += got
        while got < n:
            chunk = self._f.read(max(CHUNK, n - got))
            if not chunk:
                break
            take = chunk[: n - got]
            parts.append(take)
            got += len(take)
            # a chunk read whole is not kept: a large member's bytes are the caller's alone
            self._buf, self._at = (chunk, len(take)) if len(take) < len(chunk) else (b"", 0)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.pos += got
        if self.on_data is not None:
            self.on_data(data)
        return data

    def reserve(self, n: int, what: str) -> None:
        """Raise before reading ``n`` more bytes that would pass the limit."""
        if self.limit is not None and self.pos + n > self.limit:
            raise too_big(what, self.limit, self.reason)

    def read_exact(self, n: int, what: str) -> bytes:
        self.reserve(n, what)
        data = self.read(n)
        if len(data) < n:
            raise ShardError(f"truncated shard: {what} ends {n - len(data)} bytes early")
        return data

    def skip(self, n: int, what: str) -> None:
        """Read and drop ``n`` bytes in bounded chunks (memory stays flat)."""
        self.reserve(n, what)
        while n:
            chunk = self.read(min(n, CHUNK))
            if not chunk:
                raise ShardError(f"truncated shard: {what} ends {n} bytes early")
            n -= len(chunk)


def stage_stream(src: BinaryIO, dst: BinaryIO, compression: str, limit: int | None = None) -> int:
    """Decompress a stored shard into ``dst``; return the uncompressed byte count.

    Stops with ShardError as soon as the output would pass ``limit`` (the manifest's
    ``raw_bytes``): a decompression bomb writes at most ``limit`` bytes, never fills the disk.
    """
    stream = decompressed(src, compression)
    total = 0
    with decompressing():
        while chunk := stream.read(CHUNK):
            if limit is not None and total + len(chunk) > limit:
                raise too_big("the decompressed shard", limit)
            dst.write(chunk)
            total += len(chunk)
    return total
