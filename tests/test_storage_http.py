"""Read-only ``http://`` through a tiny local server, and ``file://`` / plain paths."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from http_server import QuietFiles, serving, static_files

from shardloader.errors import ChecksumError, ObjectNotFoundError, StorageError
from shardloader.storage import fs as storage
from shardloader.storage.fetch import fetch_shard
from shardloader.storage.retry import RetryPolicy

pytest.importorskip("aiohttp")

POLICY = RetryPolicy(
    max_attempts=3, initial_backoff=0.01, max_backoff=0.02, connect_timeout=1.0, read_timeout=1.0
)


class _Handler(QuietFiles):
    """Static files, plus ``/flaky/...`` (first GET of a path: 503) and ``/broken`` (500)."""

    counts: dict[str, int]
    lock: threading.Lock

    def _count(self) -> int:
        with self.lock:
            self.counts[self.path] = self.counts.get(self.path, 0) + 1
            return self.counts[self.path]

    def do_HEAD(self) -> None:
        self._count()
        if self.path == "/broken":
            self.send_error(500)
            return
        self.path = self.path.replace("/flaky/", "/", 1)
        super().do_HEAD()

    def do_GET(self) -> None:
        n = self._count()
        if self.path == "/broken" or (self.path.startswith("/flaky/") and n == 1):
            self.send_error(503 if n == 1 and self.path != "/broken" else 500)
            return
        self.path = self.path.replace("/flaky/", "/", 1)
        super().do_GET()


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[str, Path, dict[str, int]]]:
    root = tmp_path / "www"
    root.mkdir()
    counts: dict[str, int] = {}
    handler = type("Handler", (_Handler,), {"counts": counts, "lock": threading.Lock()})
    with serving(static_files(root, handler)) as url:
        yield url, root, counts


def test_http_read_open_and_fetch(
    http_root: tuple[str, Path, dict[str, int]], tmp_path: Path
) -> None:
    base, root, _ = http_root
    data = os.urandom(50_000)
    (root / "shard.tar").write_bytes(data)
    url = f"{base}/shard.tar"
    assert storage.read_bytes(url, policy=POLICY) == data
    with storage.open_read(url, policy=POLICY) as f:
        assert f.read(10) == data[:10]
        assert f.read() == data[10:]
    dst = tmp_path / "cache" / "shard.tar"
    fetch_shard(
        url, str(dst), sha256=hashlib.sha256(data).hexdigest(), size=len(data), policy=POLICY
    )
    assert dst.read_bytes() == data
    assert storage.exists(url, policy=POLICY)


def test_http_transient_error_is_retried(http_root: tuple[str, Path, dict[str, int]]) -> None:
    base, root, counts = http_root
    (root / "a.json").write_bytes(b'{"a": 1}')
    assert storage.read_bytes(f"{base}/flaky/a.json", policy=POLICY) == b'{"a": 1}'
    assert counts["/flaky/a.json"] >= 2


def test_http_errors(http_root: tuple[str, Path, dict[str, int]], tmp_path: Path) -> None:
    base, root, counts = http_root
    with pytest.raises(ObjectNotFoundError, match="does not exist"):
        storage.read_bytes(f"{base}/missing.json", policy=POLICY)
    assert counts["/missing.json"] <= 2  # at most a HEAD and a GET: no retries
    assert not storage.exists(f"{base}/missing.json", policy=POLICY)
    with pytest.raises(StorageError, match="3 attempts"):
        storage.read_bytes(f"{base}/broken", policy=POLICY)
    (root / "s.tar").write_bytes(b"abc" * 100)
    with pytest.raises(ChecksumError, match="s.tar"):
        fetch_shard(
            f"{base}/s.tar", str(tmp_path / "s.tar"), sha256="0" * 64, size=300, policy=POLICY
        )
    assert counts["/s.tar"] == 2  # two downloads, one streamed GET each


def test_local_paths_and_file_urls(tmp_path: Path) -> None:
    src = tmp_path / "a" / "s.bin"
    storage.write_bytes_atomic(str(src), b"local")
    assert storage.read_bytes(f"file://{src}") == b"local"
    assert storage.exists(str(src)) and storage.list_files(str(tmp_path)) == ["a/s.bin"]
    dst = tmp_path / "b" / "s.bin"
    fetch_shard(f"file://{src}", str(dst), sha256=hashlib.sha256(b"local").hexdigest(), size=5)
    assert dst.read_bytes() == b"local"
    with pytest.raises(ObjectNotFoundError):
        storage.open_read(str(tmp_path / "nope"))
    with pytest.raises(ObjectNotFoundError):
        fetch_shard(str(tmp_path / "nope"), str(dst), sha256="0" * 64, size=None)
    assert dst.read_bytes() == b"local"  # a failed fetch leaves the old file alone
    storage.remove(str(src))
    storage.remove(str(src))
    assert not storage.exists(str(src))
