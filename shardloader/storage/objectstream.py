"""One object read front to back, once, while it arrives: the GET body streams through the
caller (hashing, decompression, the cache file) and is never written whole anywhere first.

An object up to ``part_size`` is one GET.  A larger one is fetched as byte ranges of
``part_size``, up to ``parts_in_flight`` at once, and handed to the reader in order.  Each part
arrives in a background thread, so the network overlaps the caller's work; an object of at most
``INLINE_BELOW`` bytes is fetched whole by the reader's first ``read`` instead.

Faults: each part is one call under the store's :class:`~shardloader.storage.retry.RetryPolicy`
(resets, 5xx, throttling, bodies cut short, stalls past the read timeout), and the policy's
``max_total_seconds`` is a deadline for it that covers its body too: a server that drips bytes
slowly enough never to trip the read timeout is cut off there
(:mod:`~shardloader.storage.deadline`; time the part waits for the reader does not count).
A part that breaks off after some bytes resumes at the first byte it has not delivered, so the
reader sees every byte exactly once; a server that ignores ranges sends the object from its
start again and the bytes already delivered are skipped.  The object's size in the first
response must equal the size the caller expects (the manifest's ``bytes``): a larger or smaller
object is a :class:`~shardloader.errors.ChecksumError` at once, before its body is read,
unless the response is an HTML page (a proxy's or gateway's error page sent with 200 OK),
which is a transient fault and retried.

Every request after the first response names the object's version, its ETag, in
``If-Match``: an object replaced mid-download (a resumed part, a later range) is refused by the
store (412) and raised as :class:`~shardloader.errors.ObjectChangedError`, never stitched
together from two versions; the node cache fetches it once more from the start.

NOTE [part buffers]: a part holds at most ``PART_BUFFER`` unread bytes; past that its thread
waits (its connection stalls, which TCP handles) until the reader catches up.  Parts start in
order and the reader consumes them in order, so the part being read never waits for room: the
stream cannot deadlock, and its memory stays under ``parts_in_flight * PART_BUFFER``.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardloader.errors import ChecksumError, ObjectChangedError, TruncatedBodyError
from shardloader.storage.deadline import Deadline
from shardloader.storage.protocols import status_and_code
from shardloader.storage.retry import RetryPolicy, call_with_retries
from shardloader.storage.streams import Passthrough, too_large

if TYPE_CHECKING:
    from shardloader.storage.clients import Body, ObjectClient

__all__ = ["CHUNK", "INLINE_BELOW", "PART_BUFFER", "PART_SIZE", "PARTS_IN_FLIGHT", "ObjectStream"]

CHUNK = 1 << 20  # bytes per read from the socket, and the size of the chunks handed out
PART_SIZE = 64 << 20  # objects up to this are one GET; larger ones go in ranges of this size
PARTS_IN_FLIGHT = 4
PART_BUFFER = 16 << 20
INLINE_BELOW = 4 << 20  # objects up to this size are fetched in the reader's own thread


class _HtmlPageError(ConnectionError):
    """A 200 OK whose body is an HTML page, not the object: a proxy's or gateway's error page,
    transient (classified by its built-in class, :mod:`shardloader.storage.protocols`)."""


@dataclass(slots=True, eq=False)
class _Part:
    start: int
    stop: int | None  # None: to the end of the object
    got: int = 0  # bytes delivered into ``chunks`` so far (over all attempts)
    chunks: deque[bytes] = field(default_factory=deque)
    buffered: int = 0
    done: bool = False
    error: BaseException | None = None
    deadline: Deadline | None = None  # of the call fetching it (NOTE [deadline pauses])


class ObjectStream(Passthrough):
    """``read`` the bytes of ``url`` in order (a file-like object for one pass).

    ``size``: the size the object must have (None: unknown, one GET, up to ``limit`` bytes).
    """

    def __init__(
        self,
        client: ObjectClient,
        url: str,
        policy: RetryPolicy,
        size: int | None = None,
        *,
        limit: int | None = None,
        part_size: int = PART_SIZE,
        parts_in_flight: int = PARTS_IN_FLIGHT,
    ) -> None:
        self.url = url
        self.size = size
        self.limit = limit
        self._client = client
        self._policy = policy
        self._in_flight = max(1, parts_in_flight)
        if size is not None and size > part_size > 0:
            self._parts = [_Part(lo, min(lo + part_size, size)) for lo in range(0, size, part_size)]
        else:
            self._parts = [_Part(0, None)]
        self._cond = threading.Condition()
        self._started = 0
        self._current = 0  # the part being read
        self._offset = 0  # bytes of the current part's first chunk already handed out
        self._ranges: bool | None = None if len(self._parts) > 1 else False
        self._closed = False
        self._etag: str | None = None  # the version the first response was (If-Match after)
        # A small object is fetched by the reader itself on its first read: a thread would cost
        # more than the overlap it buys.
        expected = size if size is not None else limit
        self._inline = expected is not None and expected <= INLINE_BELOW
        if not self._inline:
            with self._cond:
                self._schedule_locked()

    # -- file-like ------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            out = []
            while chunk := self.read(CHUNK):
                out.append(chunk)
            return b"".join(out)
        if n == 0:
            return b""
        if self._inline and self._started == 0:
            self._started = 1
            self._fetch(self._parts[0])
        with self._cond:
            while True:
                if self._closed:
                    raise ValueError(f"{self.url}: read from a closed stream")
                if self._current >= len(self._parts):
                    return b""
                part = self._parts[self._current]
                if part.chunks:
                    chunk = part.chunks[0]
                    if self._offset == 0 and len(chunk) <= n:  # the common case: no copy
                        part.chunks.popleft()
                    else:  # a reader asking for less than a chunk: hand it out in pieces
                        chunk = chunk[self._offset : self._offset + n]
                        self._offset += len(chunk)
                        if self._offset == len(part.chunks[0]):
                            part.chunks.popleft()
                            self._offset = 0
                    part.buffered -= len(chunk)
                    self._cond.notify_all()  # room in the part's buffer
                    return chunk
                if part.error is not None:
                    err = part.error
                    self._close_locked()
                    raise err
                if part.done:
                    self._current += 1
                    self._schedule_locked()
                    continue
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._close_locked()

    def _close_locked(self) -> None:
        self._closed = True
        for part in self._parts:
            part.chunks.clear()
            part.buffered = 0
        self._cond.notify_all()

    # -- fetching -------------------------------------------------------------------------
    def _schedule_locked(self) -> None:
        """Start parts in order, up to ``parts_in_flight`` ahead of the reader; past the first,
        only once the server has shown it answers ranges."""
        while (
            not self._closed
            and self._started < len(self._parts)
            and self._started < self._current + self._in_flight
            and (self._started == 0 or self._ranges)
        ):
            part = self._parts[self._started]
            self._started += 1
            threading.Thread(
                target=self._fetch, args=(part,), daemon=True, name="shardloader-get"
            ).start()

    def _fetch(self, part: _Part) -> None:
        part.deadline = Deadline(self._policy.max_total_seconds)
        try:
            call_with_retries(
                lambda: self._fetch_once(part), url=self.url, policy=self._policy, what="read"
            )
        except BaseException as err:  # noqa: BLE001 - handed to the reader, raised there
            with self._cond:
                part.error = err
        finally:
            with self._cond:
                part.done = True
                self._cond.notify_all()

    def _fetch_once(self, part: _Part) -> None:
        """One GET of what ``part`` still lacks."""
        start = part.start + part.got
        if self._closed or (part.stop is not None and start >= part.stop):
            return
        if_match = self._etag
        try:
            body = self._client.get(self.url, start, part.stop, part.deadline, if_match)
        except Exception as err:
            if if_match is not None and _precondition_failed(err):
                raise self._changed(if_match, "the store no longer holds it (412)") from err
            raise
        try:
            skip = self._check(body, part, start)
            # where this response ends (the part's stop, else the object's end) and the bytes
            # it must deliver after any skipped ones (None: until it ends)
            end = next((x for x in (part.stop, body.total, self.size) if x is not None), None)
            expected = None if end is None else end - start
            while skip:
                dropped = body.read(min(skip, CHUNK))
                if not dropped:
                    raise TruncatedBodyError(f"{self.url}: the body ended at byte {start - skip}")
                skip -= len(dropped)
            while expected is None or expected > 0:
                data = body.read(CHUNK if expected is None else min(CHUNK, expected))
                if not data:
                    if expected is not None:
                        raise TruncatedBodyError(
                            f"{self.url}: the body ended {expected:,} bytes early (part at "
                            f"{part.start:,}, {part.got:,} bytes in)"
                        )
                    break
                if expected is not None:
                    expected -= len(data)
                if not self._deliver(part, data):
                    return
        finally:
            body.close()

    def _check(self, body: Body, part: _Part, start: int) -> int:
        """Check the response against the object we expect; return the bytes to skip (a server
        that ignored the range sends the object from byte 0)."""
        total = body.total
        etag = getattr(body, "etag", None)
        if etag is not None and etag.startswith("W/"):  # a weak ETag cannot name the bytes
            etag = None
        with self._cond:
            if self._etag is None:
                self._etag = etag
            elif etag is not None and etag != self._etag:  # the store ignored If-Match
                raise self._changed(self._etag, f"a later response is version {etag}")
        wrong = None
        if total is not None and self.size is not None and total != self.size:
            wrong = ChecksumError(
                f"{self.url} is {total:,} bytes, the manifest says {self.size:,}: the stored "
                "object is damaged or was replaced; re-upload or re-pack it"
            )
        elif total is not None and self.limit is not None and total > self.limit:
            wrong = too_large(self.url, self.limit)
        if wrong is not None:
            content_type = getattr(body, "content_type", None) or ""
            if content_type.lower().startswith("text/html"):
                raise _HtmlPageError(
                    f"{self.url}: the server answered with an HTML page ({total:,} bytes, "
                    f"Content-Type {content_type}) instead of the object: an error page of a "
                    "proxy or gateway on the way"
                )
            raise wrong
        with self._cond:
            if self._ranges is None and part is self._parts[0]:
                self._ranges = body.ranged
                if not body.ranged:  # the whole object comes in this one response
                    part.stop = None
                    del self._parts[1:]
                self._schedule_locked()
        return 0 if body.ranged else start

    def _deliver(self, part: _Part, data: bytes) -> bool:
        """Hand ``data`` to the reader; False once the stream was closed."""
        with self._cond:
            if part.buffered >= PART_BUFFER and not self._closed and not self._inline:
                if part.deadline is not None:  # the reader is behind, not the server
                    part.deadline.pause()
                try:
                    while part.buffered >= PART_BUFFER and not self._closed:
                        self._cond.wait()
                finally:
                    if part.deadline is not None:
                        part.deadline.resume()
            if self._closed:
                return False
            if self.limit is not None and part.start + part.got + len(data) > self.limit:
                raise too_large(self.url, self.limit)
            part.chunks.append(data)
            part.got += len(data)
            part.buffered += len(data)
            self._cond.notify_all()
            return True

    def _changed(self, etag: str, how: str) -> ObjectChangedError:
        return ObjectChangedError(
            f"cannot read {self.url!r}: the object changed while it was read (it was version "
            f"{etag}; {how}): it was replaced or re-uploaded meanwhile; read it again once "
            "the upload is complete"
        )


def _precondition_failed(err: BaseException) -> bool:
    """Whether ``err`` is the store's 412 to an ``If-Match`` (botocore's ClientError, or the
    HTTP client's status error)."""
    status, code = status_and_code(err)
    return status == 412 or code == "PreconditionFailed"
