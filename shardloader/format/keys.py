"""Sample keys that are safe to use as file paths.

Users write samples back to disk as ``<dir>/<key>.<ext>`` (webdataset's own tools do), so a key
from a downloaded shard must not be able to name a file outside that directory.  One rule for
every source of keys: tar member names, sidecars and Arrow ``__key__`` columns.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shardloader.errors import ShardError

if TYPE_CHECKING:  # numpy is imported where keys are measured, not by every importer
    import numpy as np

__all__ = [
    "check_key",
    "unsafe_key_reason",
    "first_unsafe_key",
    "key_lengths",
    "escape_name",
    "not_utf8",
]

_DRIVE = re.compile(r"^[A-Za-z]:")
_SURROGATE = re.compile("[\udc80-\udcff]")


def not_utf8(name: str) -> bool:
    """Whether ``name`` came from bytes that are not UTF-8: Python lists such a file name
    (``os.fsdecode``) or tar member name with each undecodable byte as a lone surrogate."""
    return not name.isascii() and _SURROGATE.search(name) is not None


def escape_name(name: str) -> str:
    """A name that is not UTF-8 made into text, reversibly: each byte that is not UTF-8 becomes
    ``%XX`` and so does each ``%`` of that name (``b"caf\\xe9"`` → ``caf%E9``, ``b"5%\\xff"``
    → ``5%25%FF``); ``urllib.parse.unquote_to_bytes`` gives the bytes back.  UTF-8 names are
    kept as they are.

    Keys and messages are UTF-8 text (JSON, Arrow strings, tar headers), so a byte name could
    not be written or named otherwise; ``pack`` keys such files by the escaped name.
    """
    if not not_utf8(name):
        return name
    return _SURROGATE.sub(lambda m: f"%{ord(m.group()) - 0xDC00:02X}", name.replace("%", "%25"))


def unsafe_key_reason(key: object) -> str | None:
    """Why ``key`` could escape a directory (or is no key at all), or None when it is safe.

    Refused: empty keys, absolute paths, Windows drive prefixes, backslashes and NULs (path
    separators / terminators on some system), ``..`` components and empty components (``a//b``).
    ``.`` components are allowed: GNU tar writes ``./name`` and it stays inside the directory.
    """
    if not isinstance(key, str):
        return f"is a {type(key).__name__}, not a string"
    if not key:
        return "is empty"
    if "\0" in key:
        return "contains a NUL character"
    if not_utf8(key):
        return f"is not UTF-8 (bytes {key.encode('utf-8', 'surrogateescape')!r})"
    if "\\" in key:
        return "contains a backslash"
    if key.startswith("/"):
        return "is an absolute path"
    if _DRIVE.match(key):
        return "starts with a drive letter"
    for part in key.split("/"):
        if part == "..":
            return "has a '..' component"
        if not part:
            return "has an empty path component"
    return None


def check_key(key: object) -> None:
    """ShardError (the place is added by the caller's boundary) unless ``key`` is safe: the
    check of every key a stored shard's stream yields."""
    reason = unsafe_key_reason(key)
    if reason is not None:
        raise ShardError(
            f"sample key {key!r} {reason}: it could escape a directory when samples are "
            "written to disk, so shardloader refuses it; rename the sample (re-pack the data)"
        )


def first_unsafe_key(keys: list[str]) -> tuple[str, str] | None:
    """(key, reason) of the first unsafe key in ``keys``, or None; fast when all are safe.

    Every rule needs one of a few characters or pairs (a NUL, a backslash, a colon, ``..``, or
    a slash or key boundary next to another): those are looked for over all keys joined by
    NULs at once (numpy over the bytes: str searches for two-character patterns that start
    with a character every key has are slow); only if one is found are the keys checked one by
    one.
    """
    try:
        joined = "\0".join(keys)
    except TypeError:  # a key that is not a string
        joined = "\0"
    if (
        "\\" not in joined
        and ":" not in joined
        and not (not joined.isascii() and _SURROGATE.search(joined))
        and not _pairs_in(joined, len(keys))
    ):
        return None  # no key can match a rule: each needs one of these
    for key in keys:
        reason = unsafe_key_reason(key)
        if reason is not None:
            return key, reason
    return None


def _pairs_in(joined: str, n: int) -> bool:
    """Whether the NUL-joined keys hold an empty key, a NUL inside a key, ``..``, or a slash
    next to a slash or a key boundary (start and end count as boundaries)."""
    import numpy as np

    if not n:
        return False
    a = np.frombuffer(("\0" + joined + "\0").encode("utf-8", "surrogateescape"), np.uint8)
    edge = (a == 0) | (a == 47)  # a key boundary or a slash
    if int(np.count_nonzero(a == 0)) != n + 1:
        return True  # a NUL inside a key
    dot = a == 46
    return bool((edge[:-1] & edge[1:]).any() or (dot[:-1] & dot[1:]).any())


def key_lengths(keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(UTF-8 byte length, start in ``joined``, ``joined``) of every key, ``joined`` holding the
    encoded keys end to end as uint8 (one C-level join for ASCII keys, the common case)."""
    import numpy as np

    text = "".join(keys)
    if text.isascii():
        lengths = np.fromiter(map(len, keys), np.int64, len(keys))
        joined = np.frombuffer(text.encode("ascii"), np.uint8)
    else:
        encoded = [k.encode("utf-8", "surrogateescape") for k in keys]
        lengths = np.fromiter(map(len, encoded), np.int64, len(keys))
        joined = np.frombuffer(b"".join(encoded), np.uint8)
    starts = np.zeros(len(keys), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return lengths, starts, joined
