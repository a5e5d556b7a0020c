"""One retry policy for every remote call, and the loop that spends it.

The layers below make a single attempt per request (each protocol's defaults in
:mod:`shardloader.storage.protocols` switch their own retries off), and :func:`call_with_retries`
owns the budget: transient faults are retried with exponential backoff and full jitter, bounded
in attempts and in total time; when the budget is spent the caller gets one
:class:`~shardloader.errors.StorageError` naming the URL, the attempts and the last cause.
Permanent errors (404, 403, bad credentials) fail at once with a remedy in the message.  Which
errors are transient is the protocol's to say (:func:`shardloader.storage.protocols.classify`).

Jitter comes from a local, unseeded ``random.Random``: it only spreads requests in time and never
touches the data order.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import tenacity

from shardloader.errors import (
    ObjectNotFoundError,
    ShardloaderError,
    StorageError,
    UsageError,
)
from shardloader.storage import protocols
from shardloader.storage.protocols import (
    CREDENTIALS,
    FORBIDDEN,
    NO_BUCKET,
    NOT_FOUND,
    THROTTLED,
    classify,
    describe,
    is_transient,
)

__all__ = [
    "RetryPolicy",
    "DEFAULT_POLICY",
    "call_with_retries",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try a remote call before giving up (picklable; crosses into workers).

    The budget is time: a transient fault (reset, refused connection, 5xx, throttling, a body
    cut short, a stall) is tried again until ``max_total_seconds`` have passed since the first
    attempt, so an endpoint that is down for a minute (a restart, a failover) is ridden out
    by the default policy.  Before attempt ``n + 1`` the call sleeps
    ``uniform(0, min(max_backoff, initial_backoff * 2**(n-1)))`` ("full jitter"), the upper
    half of that window when the server asked to slow down (429, SlowDown): the sleeps grow to
    at most ``max_backoff`` seconds and stay there.  ``max_attempts`` caps only failures that
    come faster than that: at the defaults (120 s, backoff at most 10 s) a call makes about
    25-35 attempts and the time budget ends it long before the 100th; with a small backoff or a
    large budget, the cap does.  No new attempt starts once ``max_total_seconds`` have passed.

    Through the fast clients (shard, sidecar and manifest GETs:
    :mod:`~shardloader.storage.objectstream`) ``max_total_seconds`` is also a deadline for the
    attempt under way, its body included: a server that sends a byte now and then, never idle
    for ``read_timeout``, is cut off there, so each request (at most ``ReadOptions.part_size``
    bytes) must finish within ``max_total_seconds``.  Other calls (fsspec's) end within
    ``max_total_seconds`` plus one attempt, itself bounded by the timeouts while no byte
    arrives.  ``connect_timeout`` and ``read_timeout`` (seconds without a byte) are handed to
    botocore / aiohttp.  A spent budget is one :class:`~shardloader.errors.StorageError`
    naming the URL, the attempts, the seconds and the last cause.
    """

    max_attempts: int = 100
    initial_backoff: float = 0.2
    max_backoff: float = 10.0
    max_total_seconds: float = 120.0
    connect_timeout: float = 10.0
    read_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise UsageError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise UsageError(
                "RetryPolicy needs 0 <= initial_backoff <= max_backoff, got "
                f"{self.initial_backoff} and {self.max_backoff}"
            )
        for name in ("max_total_seconds", "connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise UsageError(f"RetryPolicy.{name} must be > 0 seconds, got {value}")

    def backoff(self, attempt: int, rng: random.Random, *, throttled: bool = False) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (1-based)."""
        window = min(self.max_backoff, self.initial_backoff * 2.0 ** (attempt - 1))
        return rng.uniform(window / 2 if throttled else 0.0, window)


DEFAULT_POLICY = RetryPolicy()


# -- the retry loop ---------------------------------------------------------------------------


def _backoff(
    policy: RetryPolicy, protocol: str, rng: random.Random, state: tenacity.RetryCallState
) -> float:
    """tenacity wait: full jitter from ``rng``, never past the total budget."""
    err = state.outcome.exception() if state.outcome is not None else None
    throttled = err is not None and classify(err, protocol) == THROTTLED
    wait = policy.backoff(state.attempt_number, rng, throttled=throttled)
    left = policy.max_total_seconds - (state.seconds_since_start or 0.0)
    return max(0.0, min(wait, left))


def call_with_retries(
    fn: Callable[[], T],
    *,
    url: str,
    policy: RetryPolicy | None = None,
    what: str = "read",
) -> T:
    """Call ``fn()`` under ``policy``; retry transient faults, fail fast on permanent ones.

    ``fn`` makes one attempt with the stack's own retries off (see
    :func:`~shardloader.storage.protocols.fsspec_options`); its errors are read with the
    defaults of ``url``'s protocol.  Raises one
    :class:`StorageError` naming ``url``, the attempts and the last cause when the budget is
    spent; :class:`ObjectNotFoundError` or :class:`StorageError` with a remedy at once for
    permanent errors.  Shardloader's own errors (but :class:`TruncatedBodyError`, which is
    retried) and non-storage exceptions (bugs) pass through unchanged.
    """
    policy = policy or DEFAULT_POLICY
    protocol = protocols.protocol_of(url)
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.max_attempts)
        | tenacity.stop_after_delay(policy.max_total_seconds),
        # a local, unseeded RNG on purpose: it spreads requests, never orders data
        wait=partial(_backoff, policy, protocol, random.Random()),
        retry=tenacity.retry_if_exception(partial(is_transient, protocol=protocol)),
        before_sleep=partial(_log_retry, url, what, policy),
        reraise=False,
    )
    start = time.monotonic()
    try:
        return retrying(fn)
    except tenacity.RetryError as gave_up:
        last = gave_up.last_attempt.exception()
        attempts = gave_up.last_attempt.attempt_number
        elapsed = time.monotonic() - start
        raise StorageError(
            f"cannot {what} {url!r}: gave up after {attempts} attempt"
            f"{'s' if attempts != 1 else ''} in {elapsed:.1f} s (RetryPolicy(max_attempts="
            f"{policy.max_attempts}, max_total_seconds={policy.max_total_seconds})); last "
            f"cause: {describe(last)}; if the store is overloaded or slow, raise the policy's "
            "limits or timeouts"
        ) from last
    except ShardloaderError:
        raise
    except Exception as err:
        if not protocols.is_storage_error(err, protocol):
            raise
        raise _permanent_error(err, url, what, protocol) from err


def _log_retry(url: str, what: str, policy: RetryPolicy, state: tenacity.RetryCallState) -> None:
    err = state.outcome.exception() if state.outcome is not None else None
    sleep = state.next_action.sleep if state.next_action is not None else 0.0
    logger.info(
        "%s %s: attempt %d/%d failed (%s); retrying in %.2f s",
        what,
        url,
        state.attempt_number,
        policy.max_attempts,
        describe(err) if err is not None else "?",
        sleep,
    )


_REMEDIES = {
    NO_BUCKET: "bucket {bucket!r} does not exist at this endpoint ({cause}); check the bucket "
    "name, and the endpoint (storage_options endpoint_url or AWS_ENDPOINT_URL) and region",
    NOT_FOUND: "the object does not exist (HTTP 404: {cause}); check the URL, and that the data "
    "was packed or uploaded there completely",
    CREDENTIALS: "the credentials are missing or were rejected ({cause}); set "
    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or pass "
    "storage_options={{'key': ..., 'secret': ...}}; for a public bucket pass "
    "storage_options={{'anon': True}}",
    FORBIDDEN: "access denied (HTTP 403: {cause}); check which credentials are in use "
    "(AWS_PROFILE, AWS_ACCESS_KEY_ID or storage_options key/secret) and that the bucket policy "
    "grants them this operation on this key",
}


def _permanent_error(err: BaseException, url: str, what: str, protocol: str) -> StorageError:
    """The error to raise, with a remedy, for a failure that another attempt will not fix."""
    kind = classify(err, protocol)
    remedy = _REMEDIES.get(kind, "{cause} (a permanent error; not retried)")
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    text = f"cannot {what} {url!r}: " + remedy.format(bucket=bucket, cause=describe(err))
    return (ObjectNotFoundError if kind in (NO_BUCKET, NOT_FOUND) else StorageError)(text)
