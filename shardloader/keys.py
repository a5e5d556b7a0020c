"""Sample keys that are safe to use as file paths.

Users write samples back to disk as ``<dir>/<key>.<ext>`` (webdataset's own tools do), so a key
from a downloaded shard must not be able to name a file outside that directory.  One rule for
every source of keys: tar member names, sidecars and Arrow ``__key__`` columns.
"""

from __future__ import annotations

import re

__all__ = ["unsafe_key_reason", "first_unsafe_key"]

_DRIVE = re.compile(r"^[A-Za-z]:")


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


def first_unsafe_key(keys: list[str]) -> tuple[str, str] | None:
    """(key, reason) of the first unsafe key in ``keys``, or None; fast when all are safe."""
    try:
        joined = "\0".join(keys)
    except TypeError:  # a key that is not a string
        joined = "\0"
    framed = f"\0{joined}\0"
    if joined.count("\0") == max(len(keys) - 1, 0) and not any(
        s in framed for s in ("\0\0", "\0/", "/\0", "//", "\\", "..", ":")
    ):
        return None  # no key can match a rule: each needs one of these substrings
    for key in keys:
        reason = unsafe_key_reason(key)
        if reason is not None:
            return key, reason
    return None
