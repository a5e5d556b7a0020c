"""A small HTTP/1.1 fault-injecting proxy on 127.0.0.1, in front of the test S3 server.

Each request from the client is read whole, matched against a programmable list of rules, and
either answered by the proxy itself (503 SlowDown, 500 InternalError, 429, a reset before any
response, a stall) or forwarded to the upstream server, whose response may then be cut short
(reset or clean close mid-body, or a stall mid-body).  Everything is bounded in time: stalls wait
on the stop event, and the proxy stops by itself after ``lifetime`` seconds.

    proxy.inject("503", method="GET", times=3)         # the next 3 GETs get 503 SlowDown
    proxy.inject("reset_mid", path="/shard", every=2, times=None)  # every 2nd one, forever
    proxy.inject("500", times=None, probability=0.1, seed=3)  # 10% of all requests
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["FAULTS", "FaultProxy", "Request"]

FAULTS = (
    "503",  # 503 SlowDown, answered by the proxy
    "500",  # 500 InternalError
    "429",  # 429 TooManyRequests (what several S3-compatible stores send)
    "403",  # 403 AccessDenied
    "reset",  # TCP reset after the request, before any response
    "reset_mid",  # forward, send headers and half the body, then reset
    "close_mid",  # forward, send headers and half the body, then a clean close (FIN)
    "stall",  # send nothing for ``stall_seconds``, then close
    "stall_mid",  # send headers and half the body, stall, then close
    "drip",  # send headers, then the body one byte every ``drip_seconds`` (never idle long)
    "flip_mid",  # forward, with 64 bytes in the middle of the body inverted (transit damage)
    "html",  # 200 OK with an HTML error page, as a captive portal or gateway sends
)

_ERROR_BODIES = {
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
    "429": (429, "Too Many Requests", "TooManyRequests", "Please reduce your request rate."),
    "403": (403, "Forbidden", "AccessDenied", "Access Denied"),
}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "content-length"}


@dataclass
class _Rule:
    fault: str
    method: str | None
    path: str | None
    times: int | None
    every: int
    probability: float
    rng: random.Random
    seen: int = 0
    fired: int = 0

    def fires(self, method: str, path: str) -> bool:
        if self.method is not None and method != self.method:
            return False
        if self.path is not None and self.path not in path:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.seen += 1
        if self.seen % self.every:
            return False
        if self.probability < 1.0 and self.rng.random() >= self.probability:
            return False
        self.fired += 1
        return True


@dataclass(frozen=True)
class Request:
    """One request the proxy saw, and the fault it injected (None: forwarded untouched)."""

    method: str
    path: str
    fault: str | None


class FaultProxy:
    """Threaded proxy; ``endpoint`` is its URL, ``requests`` what it saw."""

    def __init__(
        self,
        upstream: str,
        *,
        stall_seconds: float = 3.0,
        lifetime: float = 600.0,
        drip_seconds: float = 0.2,
    ):
        parts = urlsplit(upstream)
        assert parts.hostname == "127.0.0.1", "loopback only"
        self.upstream = (parts.hostname, parts.port or 80)
        self.stall_seconds = stall_seconds
        self.drip_seconds = drip_seconds
        self.lifetime = lifetime
        self.requests: list[Request] = []
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._sock: socket.socket | None = None
        self.endpoint = ""

    # -- programming ------------------------------------------------------------------------
    def inject(
        self,
        fault: str,
        *,
        method: str | None = None,
        path: str | None = None,
        times: int | None = 1,
        every: int = 1,
        probability: float = 1.0,
        seed: int = 0,
    ) -> None:
        """Add a rule: ``fault`` on every ``every``-th matching request, ``times`` times (None:
        no limit), each time with ``probability`` (a generator seeded with ``seed``).

        Rules are tried in the order they were added; the first that fires wins.
        """
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
        rule = _Rule(fault, method, path, times, max(1, every), probability, random.Random(seed))
        with self._lock:
            self._rules.append(rule)

    def clear(self) -> None:
        """Drop every rule and the request log."""
        with self._lock:
            self._rules.clear()
            self.requests.clear()

    def count(self, method: str | None = None, path: str | None = None) -> int:
        """How many requests matched ``method`` and contained ``path``."""
        with self._lock:
            return sum(
                1
                for r in self.requests
                if (method is None or r.method == method) and (path is None or path in r.path)
            )

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> str:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._spawn(self._accept_loop, time.monotonic() + self.lifetime)
        return self.endpoint

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            conns = list(self._conns)
        for c in conns:  # wake handlers blocked in recv; they close their own sockets
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self._threads):
            t.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ----------------------------------------------------------------------------
    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="fault-proxy")  # type: ignore[arg-type]
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _accept_loop(self, deadline: float) -> None:
        assert self._sock is not None
        sock = self._sock
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                _close(conn)
                continue
            with self._lock:
                self._conns.add(conn)
            self._spawn(self._serve, conn)
        self._stop.set()

    def _match(self, method: str, path: str) -> str | None:
        with self._lock:
            fault = next((r.fault for r in self._rules if r.fires(method, path)), None)
            self.requests.append(Request(method, path, fault))
        return fault

    def _serve(self, conn: socket.socket) -> None:
        rfile = None
        try:
            conn.settimeout(30)
            rfile = conn.makefile("rb")
            while not self._stop.is_set():
                req = _read_request(rfile, conn)
                if req is None:
                    return
                method, target, headers, body = req
                fault = self._match(method, target)
                if fault == "reset":
                    _linger0(conn)
                    return
                if fault == "stall":
                    self._stop.wait(self.stall_seconds)
                    return
                if fault in _ERROR_BODIES:
                    conn.sendall(_error_response(fault, head=method == "HEAD"))
                    continue
                if fault == "html":
                    page = b"<html><body><h1>Gateway error</h1>try again later</body></html>"
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(page), page)
                    )
                    continue
                head, data = self._forward(method, target, headers, body)
                if fault == "flip_mid" and len(data) > 1:
                    mid = len(data) // 2
                    cut = data[mid : mid + 64]
                    data = data[:mid] + bytes(b ^ 0xFF for b in cut) + data[mid + len(cut) :]
                if fault in ("reset_mid", "close_mid", "stall_mid") and len(data) > 1:
                    conn.sendall(head + data[: len(data) // 2])
                    if fault == "reset_mid":
                        _linger0(conn)
                    elif fault == "stall_mid":
                        self._stop.wait(self.stall_seconds)
                    return
                if fault == "drip":
                    conn.sendall(head)
                    for i in range(len(data)):
                        if self._stop.wait(self.drip_seconds):
                            return
                        conn.sendall(data[i : i + 1])
                    return
                conn.sendall(head + data)
                if any(k.lower() == "connection" and v.lower() == "close" for k, v in headers):
                    return
        except (OSError, ValueError, http.client.HTTPException):
            return  # a client gone mid-request, or a garbled one: drop the connection
        finally:
            with self._lock:
                self._conns.discard(conn)
            if rfile is not None:
                rfile.close()  # the socket's file descriptor closes with its last user
            _close(conn)

    def _forward(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[bytes, bytes]:
        up = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            up.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                if k.lower() not in _HOP_BY_HOP:
                    up.putheader(k, v)
            if body or method in ("PUT", "POST"):
                up.putheader("Content-Length", str(len(body)))
            up.putheader("Connection", "close")
            up.endheaders(body or None)
            resp = up.getresponse()
            data = resp.read()
            out = [f"HTTP/1.1 {resp.status} {resp.reason}"]
            for k, v in resp.getheaders():
                if k.lower() not in _HOP_BY_HOP:
                    out.append(f"{k}: {v}")
            if method == "HEAD":
                length = resp.getheader("Content-Length")
                if length is not None:
                    out.append(f"Content-Length: {length}")
            else:
                out.append(f"Content-Length: {len(data)}")
            return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1"), data
        finally:
            up.close()


def _read_request(
    rfile: object, conn: socket.socket
) -> tuple[str, str, list[tuple[str, str]], bytes] | None:
    line = rfile.readline(65537)  # type: ignore[attr-defined]
    if not line.strip():
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while True:
        h = rfile.readline(65537).decode("latin-1")  # type: ignore[attr-defined]
        if h in ("\r\n", "\n", ""):
            break
        k, _, v = h.partition(":")
        headers.append((k.strip(), v.strip()))
    lower = {k.lower(): v for k, v in headers}
    if lower.get("expect", "").lower() == "100-continue":
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if "chunked" in lower.get("transfer-encoding", "").lower():
        chunks = []
        while True:
            size = int(rfile.readline().split(b";")[0].strip() or b"0", 16)  # type: ignore[attr-defined]
            if size == 0:
                while rfile.readline() not in (b"\r\n", b"\n", b""):  # type: ignore[attr-defined]
                    pass
                break
            chunks.append(rfile.read(size))  # type: ignore[attr-defined]
            rfile.readline()  # type: ignore[attr-defined]
        body = b"".join(chunks)
    else:
        body = rfile.read(int(lower.get("content-length", "0")))  # type: ignore[attr-defined]
    return method, target, headers, body


def _error_response(fault: str, *, head: bool) -> bytes:
    status, reason, code, message = _ERROR_BODIES[fault]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        "<RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    if head:
        body = b""
    headers = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
    )
    if status == 503 or status == 429:
        headers += "Retry-After: 0\r\n"
    return (headers + "\r\n").encode("latin-1") + body


def _linger0(conn: socket.socket) -> None:
    """Make the coming close send an RST instead of a FIN."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


def _close(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        pass
