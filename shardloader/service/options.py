"""How the service runs streams (:class:`ServeOptions`) and which binds need no token."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from shardloader.errors import UsageError

__all__ = ["ServeOptions", "is_loopback"]


@dataclass(frozen=True)
class ServeOptions:
    """How the service runs streams (mirrors ``shardloader serve`` options)."""

    workers: int = 2  # DataLoader worker processes per stream
    max_inflight: int = 4  # encoded batches buffered per stream (backpressure)
    max_clients: int = 8  # concurrent streams; more get 503
    token: str | None = None  # every request but /health needs "Authorization: Bearer <token>"
    ping_interval: float = 5.0  # seconds without a batch before a keep-alive frame
    prefetch_factor: int = 2  # batches each worker prepares ahead
    # NOTE [connection rules] in shardloader/service/connections.py (nginx's defaults, shorter)
    header_timeout: float = 10.0  # seconds a new connection has to send a whole request head
    idle_timeout: float = 30.0  # seconds a connection may wait for its next request
    write_timeout: float = 30.0  # seconds a client may take nothing of a response

    def __post_init__(self) -> None:
        for name, least in (("workers", 0), ("max_inflight", 1), ("max_clients", 1)):
            if getattr(self, name) < least:
                flag = name.replace("_", "-")
                raise UsageError(f"--{flag} {getattr(self, name)} must be >= {least}")
        if self.token is not None and not self.token:
            raise UsageError("the token is empty; put a secret in the --token-file")
        if not self.ping_interval > 0:
            raise UsageError(f"ping_interval {self.ping_interval} must be > 0")
        for name in ("header_timeout", "idle_timeout", "write_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise UsageError(f"--{name.replace('_', '-')} {value} must be > 0 seconds")
        if self.prefetch_factor < 1:
            raise UsageError(f"prefetch_factor {self.prefetch_factor} must be >= 1")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``: binds that need no token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
