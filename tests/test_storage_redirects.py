"""Redirects through the fast HTTP client, against real servers on 127.0.0.1 (two ports are two
origins): credentials stay with the origin they were given for, only http(s) is followed,
never https -> http, a loop ends, and every error names the chain."""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from http_server import serving

from shardloader.errors import ObjectNotFoundError, StorageError
from shardloader.storage.clients import clear_clients
from shardloader.storage.retry import RetryPolicy
from shardloader.storage.store import Store

POLICY = RetryPolicy(
    max_attempts=2, initial_backoff=0.01, max_backoff=0.02, connect_timeout=2.0, read_timeout=5.0
)
TOKEN = {"Authorization": "Bearer s3cret", "X-Api-Key": "k3y", "Cookie": "session=c00kie"}
BODY = b"shard bytes " * 100


@dataclass
class Site:
    """One origin: answers ``/data`` with BODY, ``/to?<url>`` with a 302 to ``<url>``,
    ``/loop`` with a 302 to itself; records each request's path and headers."""

    url: str = ""
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(site: Site) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def do_GET(self) -> None:
            with site.lock:
                site.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
            if self.path.startswith("/to?"):
                self.send_response(302)
                self.send_header("Location", self.path[len("/to?") :])
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/loop":
                self.send_response(302)
                self.send_header("Location", "/loop")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/data":
                self.send_response(200)
                self.send_header("Content-Length", str(len(BODY)))
                self.end_headers()
                self.wfile.write(BODY)
            else:
                self.send_error(404)

    return Handler


def _serve(site: Site, context: ssl.SSLContext | None = None) -> Iterator[Site]:
    with serving(_handler(site), context=context) as url:
        site.url = url
        yield site


@pytest.fixture
def a() -> Iterator[Site]:
    clear_clients()
    yield from _serve(Site())


@pytest.fixture
def b() -> Iterator[Site]:
    yield from _serve(Site())


def _read(url: str, headers: dict[str, str] | None = None) -> bytes:
    store = Store(url, {"headers": headers or {}}, POLICY)
    assert store.client() is not None  # the fast client, not fsspec
    with store.open_stream(limit=1 << 20) as f:  # the way shard bytes travel
        return f.read()


def test_credentials_are_dropped_on_a_hop_to_another_origin(a: Site, b: Site) -> None:
    headers = {**TOKEN, "User-Agent": "trainer/1"}
    assert _read(f"{a.url}/to?{b.url}/data", headers) == BODY
    ((path, got),) = b.seen
    assert path == "/data"
    assert "authorization" not in got and "x-api-key" not in got and "cookie" not in got
    assert got["user-agent"] == "trainer/1"  # content negotiation still goes along
    assert a.seen[0][1]["authorization"] == "Bearer s3cret"  # the origin they were given for
    # back to the first origin after a foreign hop: they stay dropped
    a.seen.clear()
    assert _read(f"{a.url}/to?{b.url}/to?{a.url}/data", headers) == BODY
    assert "authorization" not in a.seen[-1][1]


def test_a_redirect_within_the_origin_keeps_the_credentials(a: Site) -> None:
    assert _read(f"{a.url}/to?/data", TOKEN) == BODY
    assert [p for p, _ in a.seen] == ["/to?/data", "/data"]
    assert a.seen[1][1]["authorization"] == "Bearer s3cret"


def test_only_http_and_https_redirects_are_followed(a: Site) -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # a 'ftp' server that must stay unasked
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        for target in (f"ftp://127.0.0.1:{port}/x", "file:///etc/passwd", "gopher://127.0.0.1/"):
            with pytest.raises(StorageError) as err:
                _read(f"{a.url}/to?{target}", TOKEN)
            text = str(err.value)
            assert "only http and https" in text and target in text
            assert f"{a.url}/to?{target} -> {target}" in text  # the chain
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing ever connected to it
    finally:
        listener.close()
    assert len(a.seen) == 3  # refused at once: no retries


def test_a_redirect_loop_ends_naming_the_chain(a: Site) -> None:
    with pytest.raises(StorageError, match="more than 10 redirects") as err:
        _read(f"{a.url}/loop")
    assert f"{a.url}/loop -> {a.url}/loop" in str(err.value)
    assert len(a.seen) == 11  # the first request and ten hops, not retried


def test_errors_after_a_redirect_name_the_chain(a: Site, b: Site) -> None:
    with pytest.raises(ObjectNotFoundError) as err:
        _read(f"{a.url}/to?{b.url}/missing")
    assert f"redirects: {a.url}/to?{b.url}/missing -> {b.url}/missing" in str(err.value)
    closed = socket.create_server(("127.0.0.1", 0))
    gone = f"http://127.0.0.1:{closed.getsockname()[1]}/data"
    closed.close()  # nothing listens there now: connection refused, a transient fault
    with pytest.raises(StorageError, match="gave up after 2 attempts") as err:
        _read(f"{a.url}/to?{gone}")
    assert f"{a.url}/to?{gone} -> {gone}" in str(err.value)


# -- https -> http ------------------------------------------------------------------------------


@pytest.fixture
def tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ssl.SSLContext:
    """A server context with a self-signed certificate for 127.0.0.1, trusted by the client
    through ``SSL_CERT_FILE`` (what OpenSSL's default verify paths read)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert_file), str(key_file))
    return context


def test_https_never_redirects_to_plain_http(tls: ssl.SSLContext, b: Site) -> None:
    clear_clients()
    for site in _serve(Site(), tls):
        assert _read(f"{site.url}/data") == BODY  # the certificate is trusted: TLS works
        with pytest.raises(StorageError, match="from https to plain http") as err:
            _read(f"{site.url}/to?{b.url}/data", TOKEN)
        assert f"{site.url}/to?{b.url}/data -> {b.url}/data" in str(err.value)
    assert b.seen == []  # nothing went out unencrypted
    clear_clients()
