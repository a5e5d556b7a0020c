"""Shared fixtures: a real S3-compatible server on 127.0.0.1, a fault proxy, thread and worker
leak checks.

Loopback only: dummy credentials, no instance metadata, no profile or config files, no proxies
from the environment, so nothing in the AWS stack probes an address off 127.0.0.1.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# tools/'s modules (synthetic.py) after the tests' own: a tool never imports tests/, tests may
# import a tool's helpers
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from fault_proxy import FaultProxy  # noqa: E402
from http_server import serving, static_files  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from s3_server import MotoServer  # noqa: E402

# Hypothesis: no per-example deadline (a shared 2-core CI machine is slow at random moments);
# under CI the examples are derandomized, so a run is reproducible and a failure reruns the same.
hypothesis_settings.register_profile("default", deadline=None)
hypothesis_settings.register_profile("ci", deadline=None, derandomize=True)
hypothesis_settings.load_profile("ci" if os.environ.get("CI") else "default")

_LOOPBACK_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
_UNSET_ENV = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
)


@pytest.fixture(scope="session", autouse=True)
def _loopback_only_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _LOOPBACK_ENV.items():
            mp.setenv(key, value)
        for key in _UNSET_ENV:
            mp.delenv(key, raising=False)
        yield


@pytest.fixture(scope="session", autouse=True)
def _private_shard_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Datasets without an explicit cache folder stage into this session's own folder, never
    into the user's ~/.cache/shardloader (worker processes inherit the variable)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDLOADER_CACHE_DIR", str(tmp_path_factory.mktemp("shard-cache")))
        mp.delenv("SHARDLOADER_CACHE_MAX_BYTES", raising=False)
        yield


def _clear_fs_caches() -> None:
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server, started once per session."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    with MotoServer() as server:
        server.reset()
        yield server.endpoint


@pytest.fixture(scope="session")
def s3_client(s3_server: str) -> Any:
    """A plain boto3 client straight to the server (setup and inspection, not under test)."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")


@pytest.fixture
def s3_bucket(s3_server: str, s3_client: Any) -> Iterator[str]:
    """A fresh, empty bucket for one test; s3fs's instance cache is cleared around it."""
    _clear_fs_caches()
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    yield name
    _clear_fs_caches()


@pytest.fixture(scope="session")
def _proxy_session(s3_server: str) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server, stall_seconds=2.0, lifetime=3600.0) as proxy:
        yield proxy


@pytest.fixture
def fault_proxy(_proxy_session: FaultProxy) -> Iterator[FaultProxy]:
    """The fault proxy in front of the S3 server, with no rules and an empty log."""
    _proxy_session.clear()
    _clear_fs_caches()
    yield _proxy_session
    _proxy_session.clear()
    _clear_fs_caches()


@pytest.fixture
def static_site(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Plain static files (no Range support) from ``tmp_path/www`` on 127.0.0.1: (base URL,
    the folder)."""
    root = tmp_path / "www"
    root.mkdir()
    with serving(static_files(root)) as url:
        yield url, root


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves a non-daemon thread running (it would hang the interpreter)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2.0
    while True:
        leaked = [
            t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon
        ]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"test leaked non-daemon threads: {[t.name for t in leaked]}"


@pytest.fixture(scope="module", autouse=True)
def _no_leaked_workers() -> Iterator[None]:
    """Fail a module that leaves worker processes running once its garbage is collected.

    A DataLoader iterator dropped mid-epoch keeps its workers until the garbage collector
    reaches it, which may be in another test and in any thread: once its shutdown ran inside
    a later test's timed read.  So a module that leaves child processes has its garbage
    collected at its end, and then they must be gone.
    """
    import gc
    import multiprocessing

    def started() -> list[Any]:
        return [p for p in multiprocessing.active_children() if p.pid not in before]

    before = {p.pid for p in multiprocessing.active_children()}
    yield
    if not started():
        return  # nothing to collect: gc.collect() costs ~0.25 s in this big process
    gc.collect()
    deadline = time.monotonic() + 10.0
    while (leaked := started()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leaked, f"module left worker processes running: {[p.name for p in leaked]}"
