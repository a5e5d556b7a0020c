"""Read-only ``http://`` through a tiny local server, and ``file://`` / plain paths."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from http_server import QuietFiles, serving, static_files

from shardloader.errors import ChecksumError, ObjectNotFoundError, StorageError
from shardloader.storage.retry import RetryPolicy
from shardloader.storage.store import Store

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


def test_http_read_open_and_limit(
    http_root: tuple[str, Path, dict[str, int]], tmp_path: Path
) -> None:
    base, root, _ = http_root
    data = os.urandom(50_000)
    (root / "shard.tar").write_bytes(data)
    url = f"{base}/shard.tar"
    assert Store(url, {}, POLICY).read_bytes() == data
    with Store(url, {}, POLICY).open_read() as f:
        assert f.read(10) == data[:10]
        assert f.read() == data[10:]
    assert Store(url, {}, POLICY).read_bytes(limit=len(data)) == data
    with pytest.raises(ChecksumError, match="shard.tar"):
        Store(url, {}, POLICY).read_bytes(limit=len(data) - 1)
    assert Store(url, {}, POLICY).exists()


def test_http_transient_error_is_retried(http_root: tuple[str, Path, dict[str, int]]) -> None:
    base, root, counts = http_root
    (root / "a.json").write_bytes(b'{"a": 1}')
    assert Store(f"{base}/flaky/a.json", {}, POLICY).read_bytes() == b'{"a": 1}'
    assert counts["/flaky/a.json"] >= 2


def test_http_errors(http_root: tuple[str, Path, dict[str, int]], tmp_path: Path) -> None:
    base, root, counts = http_root
    with pytest.raises(ObjectNotFoundError, match="does not exist"):
        Store(f"{base}/missing.json", {}, POLICY).read_bytes()
    assert counts["/missing.json"] <= 2  # at most a HEAD and a GET: no retries
    assert not Store(f"{base}/missing.json", {}, POLICY).exists()
    with pytest.raises(StorageError, match="3 attempts"):
        Store(f"{base}/broken", {}, POLICY).read_bytes()


def test_local_paths_and_file_urls(tmp_path: Path) -> None:
    src = tmp_path / "a" / "s.bin"
    Store(str(src)).write_bytes_atomic(b"local")
    assert Store(f"file://{src}").read_bytes() == b"local"
    assert Store(str(src)).exists() and Store(str(tmp_path)).list_files() == ["a/s.bin"]
    with pytest.raises(ObjectNotFoundError):
        Store(str(tmp_path / "nope")).open_read()
    with pytest.raises(ObjectNotFoundError):
        Store(str(tmp_path / "nope")).read_bytes(limit=5)
    Store(str(src)).remove()
    Store(str(src)).remove()
    assert not Store(str(src)).exists()
