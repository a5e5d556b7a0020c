"""What the OUT lock records and hands its holder (NOTE [the OUT lock] in
:mod:`shardloader.pack.lock`): the holder's record, the lease, the refusal, the held lock;
shared by the local (flock) and the object-store (:mod:`shardloader.pack.remotelock`) locks."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

from shardloader.errors import OutputLockedError, UsageError
from shardloader.storage.store import Store

__all__ = [
    "DEFAULT_LEASE",
    "LEASE_ENV",
    "LOCK_NAME",
    "Holder",
    "OutLock",
    "lease_seconds",
    "refused",
]

LOCK_NAME = ".shardloader-lock"
DEFAULT_LEASE = 60.0
LEASE_ENV = "SHARDLOADER_LOCK_LEASE"


@dataclass(frozen=True)
class Holder:
    """Who holds the lock: the record the lock file or object carries."""

    command: str
    host: str
    pid: int
    started: float  # wall clock, seconds since the epoch
    run_id: str
    expires: float | None = None  # object stores only: the lease's end (wall clock)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        lease = ""
        if self.expires is not None:
            left = self.expires - time.time()
            lease = (
                f", lease expires in {left:.0f} s"
                if left > 0
                else f", lease expired {-left:.0f} s ago"
            )
        return (
            f"`{self.command}` on host {self.host}, pid {self.pid}, started {when} "
            f"(run {self.run_id}{lease})"
        )

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Holder | None:
        try:
            d = json.loads(data)
            return cls(
                str(d["command"]),
                str(d["host"]),
                int(d["pid"]),
                float(d["started"]),
                str(d["run_id"]),
                None if d.get("expires") is None else float(d["expires"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def lease_seconds(lease: float | None = None) -> float:
    """The lease: ``lease``, else ``$SHARDLOADER_LOCK_LEASE``, else :data:`DEFAULT_LEASE`."""
    if lease is None:
        raw = os.environ.get(LEASE_ENV)
        try:
            lease = float(raw) if raw else DEFAULT_LEASE
        except ValueError as err:
            raise UsageError(f"${LEASE_ENV}={raw!r}: give the lease in seconds") from err
    if not lease > 0:
        raise UsageError(f"lock lease {lease!r} must be > 0 seconds")
    return lease


def refused(out: Store, holder: Holder | None) -> OutputLockedError:
    who = holder.describe() if holder is not None else "another run (not yet recorded)"
    return OutputLockedError(
        f"output {out.url!r} is locked by {who}; two runs must not write one OUT at once: wait "
        "for it to finish, or pick another OUT"
    )


class OutLock:
    """The lock a run holds; ``run_id`` names the run (multipart uploads record it)."""

    def __init__(self, out: Store, holder: Holder) -> None:
        self.out = out
        self.holder = holder
        self.run_id = holder.run_id
        self._lost: str | None = None

    def check(self) -> None:
        """Raise if the lock was lost (an object store's lease taken over): call before the
        manifest is written."""
        if self._lost is not None:
            raise OutputLockedError(
                f"output {self.out.url!r}: this run lost its lock ({self._lost}); its manifest "
                "is not written. Make sure one run at a time writes OUT, then re-run with --resume"
            )
