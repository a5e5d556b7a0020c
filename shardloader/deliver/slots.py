"""Slots of shared memory lent out as numpy views and taken back once no view is alive.

The worker ring (:class:`shardloader.deliver.transport.Ring`) hands a slot's bytes to the
training loop as a view the batch tensors are built over, keeps only a weak reference to it,
and gives the slot back to its writer when that view is gone.  This is that rule, in one place.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

__all__ = ["lend", "take_back"]


def lend(views: list[Any], i: int, view: np.ndarray) -> np.ndarray:
    """Record that slot ``i`` is read through ``view`` (weakly: the view's users keep it alive)."""
    views[i] = weakref.ref(view)
    return view


def take_back(states: np.ndarray, views: list[Any], lent: int, free: int) -> None:
    """Mark ``free`` every slot in state ``lent`` (``states`` flat, one byte a slot) whose
    view nothing refers to any more."""
    for i in np.flatnonzero(states == lent).tolist():
        ref = views[i]
        if ref is None or ref() is None:
            views[i] = None
            states[i] = free
