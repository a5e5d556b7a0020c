"""RetryPolicy, error classification and the retry loop, without a server."""

from __future__ import annotations

import pickle
import random
import time

import pytest

from shardloader.errors import (
    ChecksumError,
    ObjectNotFoundError,
    ShardloaderError,
    StorageError,
    TruncatedBodyError,
    UsageError,
)
from shardloader.storage.protocols import classify, fsspec_options, is_transient
from shardloader.storage.retry import RetryPolicy, call_with_retries

FAST = RetryPolicy(max_attempts=4, initial_backoff=0.001, max_backoff=0.01, max_total_seconds=5.0)
URL = "s3://bucket/ds/shard-00000.tar.zst"


def client_error(code: str, status: int, op: str = "GetObject") -> Exception:
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        op,
    )


def wrapped(inner: Exception, outer: Exception) -> Exception:
    """``outer`` raised ``from inner``, the way s3fs translates botocore errors."""
    outer.__cause__ = inner
    return outer


def in_context(earlier: Exception, outer: Exception) -> Exception:
    """``outer`` raised while handling ``earlier``."""
    outer.__context__ = earlier
    return outer


class Flaky:
    """Fails with the given errors in turn, then returns ``value``."""

    def __init__(self, *errors: BaseException, value: object = b"ok") -> None:
        self.errors = list(errors)
        self.value = value
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.value


# -- policy ----------------------------------------------------------------------------------


def test_policy_defaults_and_pickle() -> None:
    p = RetryPolicy()
    assert (p.max_attempts, p.initial_backoff, p.max_backoff, p.max_total_seconds) == (
        100,
        0.2,
        10.0,
        120.0,
    )
    assert pickle.loads(pickle.dumps(p)) == p
    with pytest.raises(AttributeError):
        p.max_attempts = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"initial_backoff": -1.0},
        {"initial_backoff": 5.0, "max_backoff": 1.0},
        {"max_total_seconds": 0},
        {"read_timeout": 0},
        {"connect_timeout": -1},
    ],
)
def test_policy_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(UsageError, match="RetryPolicy"):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_backoff_is_full_jitter_capped_and_throttle_waits_longer() -> None:
    p = RetryPolicy(initial_backoff=0.2, max_backoff=1.0)
    rng = random.Random(0)
    for attempt in range(1, 10):
        window = min(1.0, 0.2 * 2 ** (attempt - 1))
        waits = [p.backoff(attempt, rng) for _ in range(50)]
        assert all(0 <= w <= window for w in waits)
        assert all(
            window / 2 <= p.backoff(attempt, rng, throttled=True) <= window for _ in range(50)
        )


def test_jitter_never_touches_the_global_rng() -> None:
    random.seed(1234)
    state = random.getstate()
    call_with_retries(Flaky(ConnectionResetError(), ConnectionResetError()), url=URL, policy=FAST)
    assert random.getstate() == state


# -- classification ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("err", "kind"),
    [
        (client_error("SlowDown", 503), "throttled"),
        (client_error("TooManyRequests", 429), "throttled"),
        (client_error("InternalError", 500), "transient"),
        (client_error("ServiceUnavailable", 503), "transient"),
        (client_error("502", 502), "transient"),
        (client_error("RequestTimeout", 400), "transient"),
        (client_error("NoSuchKey", 404), "not_found"),
        (client_error("404", 404, "HeadObject"), "not_found"),
        (client_error("NoSuchBucket", 404), "no_bucket"),
        (client_error("AccessDenied", 403), "forbidden"),
        (client_error("403", 403, "HeadObject"), "forbidden"),
        (client_error("InvalidAccessKeyId", 403), "credentials"),
        (client_error("SignatureDoesNotMatch", 403), "credentials"),
        (client_error("InvalidArgument", 400), "permanent"),
        # s3fs's translations keep the ClientError as the cause; the code wins over the type
        (wrapped(client_error("SlowDown", 503), OSError(16, "Please reduce")), "throttled"),
        (wrapped(client_error("NoSuchBucket", 404), FileNotFoundError("b")), "no_bucket"),
        (wrapped(client_error("403", 403), PermissionError("denied")), "forbidden"),
        # the outermost exception that says something decides, not an older one in its context
        (
            in_context(wrapped(client_error("404", 404), FileNotFoundError("k")), TimeoutError()),
            "transient",
        ),
        (ConnectionResetError(), "transient"),
        (TimeoutError(), "transient"),
        (TruncatedBodyError("short"), "transient"),
        (FileNotFoundError("gone"), "not_found"),
        (PermissionError("no"), "forbidden"),
        (OSError(5, "EIO"), "permanent"),
    ],
)
def test_classify(err: Exception, kind: str) -> None:
    assert classify(err, "s3") == kind


def test_classify_stack_exception_types() -> None:
    import aiohttp
    import botocore.exceptions as bx
    from fsspec.exceptions import FSTimeoutError

    assert is_transient(aiohttp.ClientPayloadError("Response payload is not completed"), "http")
    assert is_transient(bx.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), "s3")
    assert is_transient(bx.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), "s3")
    assert is_transient(FSTimeoutError(), "memory")  # any protocol
    assert classify(bx.NoCredentialsError(), "s3") == "credentials"
    info = aiohttp.RequestInfo(
        aiohttp.client.URL("http://127.0.0.1/x"),
        "GET",
        {},
        aiohttp.client.URL("http://127.0.0.1/x"),
    )  # type: ignore[arg-type]
    assert classify(aiohttp.ClientResponseError(info, (), status=503), "https") == "transient"
    assert classify(aiohttp.ClientResponseError(info, (), status=403), "s3") == "forbidden"
    # our own errors are final; a checksum mismatch is handled by the caller, not retried here
    assert not is_transient(ChecksumError("bad"), "s3")
    assert not is_transient(StorageError("gave up"), "s3")


def test_truncated_body_is_in_the_tree_and_the_one_transient_error_of_ours() -> None:
    import shardloader
    from shardloader import errors

    assert TruncatedBodyError is errors.TruncatedBodyError is shardloader.TruncatedBodyError
    err = TruncatedBodyError("got 10 of 20 bytes")
    assert isinstance(err, ShardloaderError) and isinstance(err, ConnectionError)
    assert is_transient(err, "s3")


# -- the loop ----------------------------------------------------------------------------------


def test_transient_faults_are_retried_until_success() -> None:
    fn = Flaky(
        wrapped(client_error("SlowDown", 503), OSError(16, "slow down")),
        ConnectionResetError(104, "reset"),
        TruncatedBodyError("short body"),
    )
    assert call_with_retries(fn, url=URL, policy=FAST) == b"ok"
    assert fn.calls == 4


def test_exhausted_retries_raise_one_storage_error_naming_url_attempts_cause() -> None:
    fn = Flaky(*[ConnectionResetError(104, "Connection reset by peer")] * 10)
    with pytest.raises(StorageError) as info:
        call_with_retries(fn, url=URL, policy=FAST, what="download")
    assert fn.calls == 4
    msg = str(info.value)
    assert URL in msg and "4 attempts" in msg and "ConnectionResetError" in msg
    assert "download" in msg
    assert isinstance(info.value.__cause__, ConnectionResetError)


def test_total_time_budget_bounds_a_call() -> None:
    policy = RetryPolicy(
        max_attempts=1000, initial_backoff=0.05, max_backoff=0.05, max_total_seconds=0.4
    )
    fn = Flaky(*[TimeoutError("slow")] * 1000)
    start = time.monotonic()
    with pytest.raises(StorageError, match="gave up after"):
        call_with_retries(fn, url=URL, policy=policy)
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 1.5
    assert 2 < fn.calls < 1000


@pytest.mark.parametrize(
    ("err", "cls", "remedy"),
    [
        (FileNotFoundError("bucket/key"), ObjectNotFoundError, "does not exist"),
        (
            wrapped(client_error("NoSuchBucket", 404), FileNotFoundError("x")),
            ObjectNotFoundError,
            "bucket 'bucket' does not exist",
        ),
        (
            wrapped(client_error("AccessDenied", 403), PermissionError("x")),
            StorageError,
            "bucket policy",
        ),
        (
            wrapped(client_error("InvalidAccessKeyId", 403), PermissionError("x")),
            StorageError,
            "AWS_ACCESS_KEY_ID",
        ),
        (OSError(22, "Invalid argument"), StorageError, "permanent"),
    ],
)
def test_permanent_errors_fail_at_once_with_a_remedy(
    err: Exception, cls: type[Exception], remedy: str
) -> None:
    fn = Flaky(err)
    with pytest.raises(cls) as info:
        call_with_retries(fn, url=URL, policy=FAST)
    assert fn.calls == 1
    assert URL in str(info.value) and remedy in str(info.value)
    assert info.value.__cause__ is err


def test_not_found_is_a_file_not_found_error() -> None:
    with pytest.raises(FileNotFoundError):
        call_with_retries(Flaky(FileNotFoundError("k")), url=URL, policy=FAST)


def test_own_errors_and_bugs_pass_through_unchanged() -> None:
    bad = ChecksumError("mismatch")
    with pytest.raises(ChecksumError) as info:
        call_with_retries(Flaky(bad), url=URL, policy=FAST)
    assert info.value is bad
    with pytest.raises(TypeError):
        call_with_retries(Flaky(TypeError("bug")), url=URL, policy=FAST)
    with pytest.raises(KeyboardInterrupt):
        call_with_retries(Flaky(KeyboardInterrupt()), url=URL, policy=FAST)
    assert issubclass(ObjectNotFoundError, ShardloaderError)


# -- options for the stack below -------------------------------------------------------------------


def test_s3_options_switch_off_botocore_retries_and_set_timeouts() -> None:
    policy = RetryPolicy(connect_timeout=3.0, read_timeout=7.0)
    opts = fsspec_options("s3://b/k", {"endpoint_url": "http://127.0.0.1:9000"}, policy)
    assert opts["endpoint_url"] == "http://127.0.0.1:9000"
    assert opts["config_kwargs"] == {
        "retries": {"total_max_attempts": 1, "mode": "standard"},
        "connect_timeout": 3.0,
        "read_timeout": 7.0,
    }
    # no endpoint is invented: botocore reads AWS_ENDPOINT_URL itself
    assert "endpoint_url" not in fsspec_options("s3://b/k", None, RetryPolicy())


def test_explicit_user_options_win_key_by_key() -> None:
    user = {"config_kwargs": {"read_timeout": 99, "retries": {"max_attempts": 3}}, "anon": True}
    opts = fsspec_options("s3://b/k", user, RetryPolicy(connect_timeout=3.0))
    assert opts["anon"] is True
    assert opts["config_kwargs"] == {
        "read_timeout": 99,
        "retries": {"max_attempts": 3},
        "connect_timeout": 3.0,
    }
    assert user == {
        "config_kwargs": {"read_timeout": 99, "retries": {"max_attempts": 3}},
        "anon": True,
    }


def test_fsspec_config_supplies_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec.config

    monkeypatch.setitem(
        fsspec.config.conf, "s3", {"config_kwargs": {"connect_timeout": 2}, "requester_pays": True}
    )
    opts = fsspec_options("s3://b/k", {"config_kwargs": {"read_timeout": 4}}, RetryPolicy())
    assert opts["requester_pays"] is True
    assert opts["config_kwargs"]["connect_timeout"] == 2
    assert opts["config_kwargs"]["read_timeout"] == 4
    assert opts["config_kwargs"]["retries"]["total_max_attempts"] == 1


def test_http_options_set_socket_timeouts_without_a_total_limit() -> None:
    import aiohttp

    opts = fsspec_options(
        "https://host/x", None, RetryPolicy(connect_timeout=2.0, read_timeout=5.0)
    )
    timeout = opts["client_kwargs"]["timeout"]
    assert isinstance(timeout, aiohttp.ClientTimeout)
    assert (timeout.total, timeout.sock_connect, timeout.sock_read) == (None, 2.0, 5.0)
    mine = aiohttp.ClientTimeout(total=1)
    assert (
        fsspec_options("http://h/x", {"client_kwargs": {"timeout": mine}}, RetryPolicy())[
            "client_kwargs"
        ]["timeout"]
        is mine
    )
    assert fsspec_options("file:///tmp/x", {"auto_mkdir": True}, RetryPolicy()) == {
        "auto_mkdir": True
    }
