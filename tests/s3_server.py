"""A real S3-compatible server for the tests: ``moto`` in server mode on 127.0.0.1.

Started once per test session as a subprocess (its log goes to a temp file, never an undrained
pipe), reset between tests with ``POST /moto-api/reset``, stopped at the end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

__all__ = ["MotoServer"]

# Loopback only: never route through a proxy from the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_PORT_RE = re.compile(rb"Running on http://127\.0\.0\.1:(\d+)")


class MotoServer:
    """``python -m moto.server -H 127.0.0.1 -p 0``, a context manager; ``.endpoint``: its URL."""

    def __init__(self, start_timeout: float = 60.0, port: int = 0) -> None:
        self.start_timeout = start_timeout
        self.port = port  # 0: any free one; a restart names the one it had
        self.endpoint = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: tempfile._TemporaryFileWrapper[bytes] | None = None

    def start(self) -> str:
        self._log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log")  # noqa: SIM115
        env = dict(os.environ, AWS_EC2_METADATA_DISABLED="true", PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + self.start_timeout
        port = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited early:\n{self._read_log()}")
            m = _PORT_RE.search(self._read_log().encode())
            if m:
                port = int(m.group(1))
                break
            time.sleep(0.05)
        if port is None:
            self.stop()
            raise RuntimeError(f"moto server did not report its port:\n{self._read_log()}")
        self.endpoint = f"http://127.0.0.1:{port}"
        while time.monotonic() < deadline:
            try:
                self.reset()
                return self.endpoint
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto server at {self.endpoint} did not answer:\n{self._read_log()}")

    def reset(self) -> None:
        """Forget every bucket and object (moto's own reset endpoint)."""
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST", data=b"")
        with _NO_PROXY.open(req, timeout=10) as resp:
            resp.read()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _read_log(self) -> str:
        assert self._log is not None
        with open(self._log.name, "rb") as f:
            return f.read().decode(errors="replace")

    def __enter__(self) -> MotoServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
