"""Byte sizes as people write them (``256MB``, ``1GiB``) and as they read them (``1.2 GB``)."""

from __future__ import annotations

import re

from shardloader.errors import UsageError

__all__ = ["human_bytes", "parse_size"]

# decimal k, m, g, t (with or without "b") and binary kib, mib, gib, tib
_UNITS = {
    "": 1,
    "b": 1,
    **{p + b: 10 ** (3 * i) for i, p in enumerate("kmgt", 1) for b in ("", "b")},
    **{p + "ib": 2 ** (10 * i) for i, p in enumerate("kmgt", 1)},
}


def parse_size(text: str) -> int:
    """``"256MB"`` → 256000000, ``"1GiB"`` → 1073741824, ``"0"`` → 0 (no limit)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise UsageError(f"size {text!r}: use a number with an optional unit (KB, MB, GiB, ...)")
    return int(float(m.group(1)) * _UNITS[unit])


def human_bytes(n: float) -> str:
    """``1234567`` → ``"1.2 MB"`` (decimal units, as ``du -h --si`` prints them)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
