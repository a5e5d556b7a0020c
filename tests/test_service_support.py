"""Shared pieces of the service tests: server processes, client processes, a dropping proxy,
pipeline factories the servers import, and batch digests.

Run as a script it is the client process of the tests::

    python tests/test_service_support.py URL [URL...] --rank R --world W --epoch E --out F.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from shardloader.batching.raw import ByteColumn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
UNEVEN = [1, 120, 3, 0, 17, 59]  # 200 samples over wildly uneven shards, one empty
READY_TIMEOUT = 120.0  # seconds: two loaded cores start several torch processes at once


# -- pipelines (imported by the server processes through PYTHONPATH) ---------------------------


class Noise:
    """A seeded augmentation: random draws from the global RNGs the dataset seeds per batch."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        out = dict(sample)
        out["noise"] = torch.randint(0, 1 << 30, (3,))
        out["jitter"] = float(torch.rand(()))
        return out


class Inflate(Noise):
    """Noise plus a 256 KiB tensor per sample: frames large enough to outrun socket buffers."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        out = super().__call__(sample)
        out["big"] = torch.full((256, 1024), sample["__index__"] % 251, dtype=torch.uint8)
        return out


class FailAt(Noise):
    """Noise, and a DecodeError at one sample: a pipeline that breaks mid-epoch."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if sample["__index__"] == int(os.environ.get("SERVICE_TEST_FAIL_AT", "-1")):
            from shardloader.errors import DecodeError

            raise DecodeError(f"sample {sample['__key__']}: injected failure")
        return super().__call__(sample)


def _dataset(transform: Any, batch_size: int, rank: int = 0, world: int = 1) -> Any:
    import shardloader as sl

    cache = sl.CacheOptions(dir=os.environ["SERVICE_TEST_CACHE"])
    return sl.ShardedDataset(
        os.environ["SERVICE_TEST_DATA"],
        batch_size=batch_size,
        shuffle=True,
        seed=7,
        transform=transform,
        read=sl.ReadOptions(cache=cache),
        world=sl.World(rank, world),
    )


def small_factory() -> Any:
    return _dataset(Noise(), 8)


def big_factory() -> Any:
    return _dataset(Inflate(), 4)


def failing_factory() -> Any:
    return _dataset(FailAt(), 8)


PATH_OPTIONS = ["--batch-size", "8", "--shuffle", "--seed", "7"]


def path_pipeline() -> Any:
    """The dataset ``serve DATA --batch-size 8 --shuffle --seed 7`` builds (PATH_OPTIONS)."""
    from shardloader.presets import DatasetPreset
    from shardloader.service.pipeline import load_pipeline

    preset = DatasetPreset(
        batch_size=8, shuffle=True, seed=7, cache_dir=os.environ["SERVICE_TEST_CACHE"]
    )
    return load_pipeline(os.environ["SERVICE_TEST_DATA"], preset)


def local_batches(
    factory: Any, rank: int, world: int, epoch: int = 0, position: int = 0, num_workers: int = 0
) -> list[Any]:
    """What a local loader yields for this place (the reference for every remote run)."""
    import shardloader as sl

    ds = factory().for_rank(rank, world)
    loader = sl.make_loader(ds, num_workers=num_workers)
    if position:
        state = {**loader.state_dict(), "epoch": epoch, "position": position}
        loader.load_state_dict(state)
    else:
        ds.set_epoch(epoch)
    return list(loader)


# -- comparing batches --------------------------------------------------------------------------


def canonical(value: Any) -> Any:
    """A JSON-able form that is equal exactly when the values are byte-for-byte equal."""
    if isinstance(value, torch.Tensor):
        raw = (
            value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            if value.numel()
            else b""
        )
        return ["tensor", str(value.dtype), list(value.shape), hashlib.sha256(raw).hexdigest()]
    if isinstance(value, np.ndarray):
        return [
            "ndarray",
            value.dtype.str,
            list(value.shape),
            hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest(),
        ]
    if isinstance(value, dict):  # a RawBatch is told apart from a plain dict
        return [type(value).__name__, [[k, canonical(v)] for k, v in value.items()]]
    if isinstance(value, ByteColumn):
        return ["column", [None if v is None else canonical(v) for v in value]]
    if isinstance(value, list | tuple):
        return [type(value).__name__, [canonical(v) for v in value]]
    if isinstance(value, bytes):
        return ["bytes", hashlib.sha256(value).hexdigest()]
    if isinstance(value, float):
        return ["float", value.hex()]
    return [type(value).__name__, value]


def digest(batch: Any) -> str:
    return hashlib.sha256(json.dumps(canonical(batch)).encode()).hexdigest()


def ids_and_pads(batch: dict[str, Any]) -> tuple[list[int], list[bool]]:
    return [int(i) for i in batch["__index__"]], [bool(p) for p in batch["__pad__"]]


# -- server processes ---------------------------------------------------------------------------


def server_env(data: str, cache: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, ROOT, env.get("PYTHONPATH")) if p)
    env.update(
        SERVICE_TEST_DATA=data,
        SERVICE_TEST_CACHE=cache,
        NO_PROXY="127.0.0.1",
        no_proxy="127.0.0.1",
        **extra,
    )
    return env


@contextlib.contextmanager
def dataset_env(tmp_path_factory: Any, compression: str, **extra: str) -> Iterator[dict[str, str]]:
    """:data:`UNEVEN` written with ``compression`` and a cache folder, named in this process's
    environment (its local reference loaders read the same) and in the server environment it
    yields (``extra``: more variables for the servers)."""
    import pytest  # neither at the top: server processes import this module
    from helpers import write_dataset

    data = str(tmp_path_factory.mktemp("data"))
    write_dataset(data, UNEVEN, compression=compression)
    cache = str(tmp_path_factory.mktemp("cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SERVICE_TEST_DATA", data)
        mp.setenv("SERVICE_TEST_CACHE", cache)
        yield server_env(data, cache, **extra)


class ServerProcess:
    """``python -m shardloader serve ...`` on 127.0.0.1 with a free port."""

    _count = 0

    def __init__(
        self,
        args: list[str],
        workdir: str,
        env: dict[str, str],
        max_files: int | None = None,
        module: str = "shardloader",
        new_group: bool = False,
    ) -> None:
        """``max_files``: the server's file descriptor limit (soft and hard); ``module``:
        what ``python -m`` runs (a launcher that calls the CLI); ``new_group``: the server
        leads a process group of its own, with its stream workers in it, as systemd starts
        a service (:meth:`stop_group`)."""
        ServerProcess._count += 1
        n = ServerProcess._count
        self.port_file = os.path.join(workdir, f"server-{n}.port")
        self.log_path = os.path.join(workdir, f"server-{n}.log")
        self.args = args
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "serve",
                *args,
                "--port",
                "0",
                "--port-file",
                self.port_file,
                "--log-level",
                "warning",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            preexec_fn=None if max_files is None else functools.partial(_limit_files, max_files),
            start_new_session=new_group,
        )
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.port_file):
                with open(self.port_file) as f:
                    self.port = int(f.read())
                try:
                    with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                        if r.status == 200:
                            return self
                except OSError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")[-4000:]

    def kill(self) -> None:
        """kill -9: no shutdown, no goodbye to clients."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop_group(self) -> None:
        """SIGTERM to the server's process group (systemd's default stop), then wait; kill -9
        to the group if it is still there 15 s later (and say so: a test should fail)."""
        pgid = os.getpgid(self.proc.pid)
        assert pgid == self.proc.pid, "started without new_group=True"
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=15)
            raise AssertionError("the server ignored SIGTERM for 15 s") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def metrics(self, token: str | None = None) -> dict[str, float]:
        return parse_metrics(get(f"{self.url}/metrics", token)[1].decode())


def _limit_files(n: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def start_servers(
    specs: list[list[str]], workdir: str, env: dict[str, str], new_group: bool = False
) -> list[ServerProcess]:
    """Start several servers at once (their start-up is mostly importing torch) and wait."""
    servers = [ServerProcess(args, workdir, env, new_group=new_group) for args in specs]
    try:
        for s in servers:
            s.wait_ready()
    except Exception:
        for s in servers:
            s.stop()
        raise
    return servers


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {"name{labels}": value}; fails on a line that is not valid."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def get(url: str, token: str | None = None, method: str = "GET") -> tuple[int, bytes, Any]:
    """(status, body, headers) of one plain request; HTTP errors are returned, not raised."""
    req = urllib.request.Request(url, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers


class InProcessServer:
    """``serve()`` in a daemon thread of this process: cheap, for tests that need no process."""

    def __init__(self, dataset: Any, **options: Any) -> None:
        from shardloader.service.app import create_app
        from shardloader.service.options import ServeOptions
        from shardloader.service.server import uvicorn_server

        serve_options = ServeOptions(**options)
        self.app = create_app(dataset, serve_options)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.server = uvicorn_server(self.app, serve_options)
        self._thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self._sock]},
            daemon=True,
            name="in-process-server",
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> InProcessServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()


# -- a proxy that drops connections mid-stream ----------------------------------------------------


class DropProxy:
    """TCP relay on 127.0.0.1 that resets a connection once ``cut`` bytes of response have
    passed on it, ``drops`` times in all; then it relays untouched.

    One thread per connection relays both directions (select), so a reset is sent at once:
    no other thread sits in ``recv`` on a socket being closed.
    """

    def __init__(self, upstream_port: int, cut: int, drops: int) -> None:
        self.upstream = upstream_port
        self.cut, self.drops = cut, drops
        self.connections = 0
        self.dropped = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="drop-proxy").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):  # wakes the accept: close alone leaves it blocked
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _take_drop(self) -> bool:
        with self._lock:
            if self.dropped >= self.drops:
                return False
            self.dropped += 1
            return True

    def _relay(self, client: socket.socket) -> None:
        import selectors

        try:
            server = socket.create_connection(("127.0.0.1", self.upstream))
        except OSError:
            client.close()
            return
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, server)
        sel.register(server, selectors.EVENT_READ, client)
        passed = 0
        reset = False
        try:
            while not self._stop.is_set() and not reset:
                for key, _ in sel.select(timeout=0.5):
                    src, dst = key.fileobj, key.data
                    data = src.recv(1 << 16)  # type: ignore[union-attr]
                    if not data:
                        return
                    if src is server and passed + len(data) >= self.cut and self._take_drop():
                        dst.sendall(data[: max(self.cut - passed, 0)])
                        reset = True  # a crashed middlebox: RST both ways, no clean close
                        break
                    dst.sendall(data)
                    if src is server:
                        passed += len(data)
        except OSError:
            pass
        finally:
            sel.close()
            for s in (client, server):
                if reset:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()


# -- the client process ---------------------------------------------------------------------------


def client_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--token")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from shardloader.options import World
    from shardloader.service import RemoteLoader

    world = World(args.rank, args.world)
    loader = RemoteLoader(args.urls, world=world, token=args.token, prefetch=1)
    loader.set_epoch(args.epoch)
    steps = len(loader)
    out: dict[str, Any] = {"steps": steps, "digests": [], "ids": [], "pads": []}
    for batch in loader:
        ids, pads = ids_and_pads(batch)
        out["digests"].append(digest(batch))
        out["ids"].append(ids)
        out["pads"].append(pads)
        print(f"step {len(out['digests'])}", flush=True)  # the test watches progress
        time.sleep(args.sleep)
    out["state"] = loader.state_dict()
    out["reconnects"] = loader.reconnects
    with open(args.out + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(args.out + ".tmp", args.out)


def start_client(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_client(proc: subprocess.Popen[str], out: str, timeout: float = 120) -> dict[str, Any]:
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"client failed ({proc.returncode}):\n{stderr[-3000:]}"
    with open(out) as f:
        return json.load(f)


def test_drop_proxy_cuts_then_relays() -> None:
    """The proxy itself: the first connection is cut after ``cut`` bytes, the next relayed."""
    upstream = socket.create_server(("127.0.0.1", 0))
    payload = bytes(range(256)) * 1024

    def serve() -> None:
        for _ in range(2):
            conn, _ = upstream.accept()
            conn.recv(16)
            try:
                conn.sendall(payload)
            except OSError:
                pass
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    proxy = DropProxy(upstream.getsockname()[1], cut=1000, drops=1)
    try:
        got = []
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", proxy.port)) as c:
                c.sendall(b"hi")
                data = b""
                try:
                    while chunk := c.recv(1 << 16):
                        data += chunk
                except ConnectionResetError:
                    pass
                got.append(len(data))
        assert got[0] <= 1000 and got[1] == len(payload)
        assert proxy.dropped == 1
    finally:
        proxy.close()
        upstream.close()
        t.join(5)


if __name__ == "__main__":
    client_main()
