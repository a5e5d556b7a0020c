"""Passes still open when the interpreter exits are closed before it tears its modules down.

NOTE [closing a pass left early]
    A pass is a generator: a loop that breaks out of it and drops it closes it at once, and its
    ``finally`` blocks stop the read-ahead threads and close the shards.  A script that keeps
    the iterator (``it = iter(loader); next(it)``) or lets it sit in a reference cycle drops
    it only at interpreter teardown, after module globals are gone: the read-ahead pool's
    ``shutdown`` then fails inside ``concurrent.futures`` (``'NoneType' object has no attribute
    'Empty'``) and Python prints "Exception ignored in: <generator object ...>" on a clean
    exit.  So every pass is noted, weakly (noting keeps nothing alive), and an ``atexit``
    hook closes the passes still open.  ``atexit`` hooks run after ``threading`` has joined
    the pools' threads but before any module is torn down, so each ``finally`` runs with
    the whole library in place, exactly as when the pass is dropped early.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any, TypeVar

__all__ = ["noted"]

log = logging.getLogger(__name__)

T = TypeVar("T", bound=Iterator[Any])

_OPEN: weakref.WeakSet[Iterator[Any]] = weakref.WeakSet()
_LOCK = threading.Lock()
_HOOKED = False


def noted(passes: T) -> T:
    """``passes`` (a generator), closed at interpreter exit if it is still open then (NOTE
    [closing a pass left early])."""
    global _HOOKED
    with _LOCK:
        if not _HOOKED:
            atexit.register(_close_open)
            _HOOKED = True
        _OPEN.add(passes)
    return passes


def _close_open() -> None:
    """Close every pass still open; one that fails to close is logged, the others closed."""
    with _LOCK:
        left = list(_OPEN)
        _OPEN.clear()
    for gen in left:
        try:
            gen.close()  # type: ignore[attr-defined]
        except Exception:
            log.warning("closing a pass left open at exit failed", exc_info=True)
