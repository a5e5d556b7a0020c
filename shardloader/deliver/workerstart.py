"""How DataLoader workers start, and a check at ``make_loader`` that they can.

NOTE [worker start methods]
    ``make_loader`` leaves the start method to torch and Python: ``fork`` on Linux up to
    Python 3.13, ``forkserver`` from 3.14, ``spawn`` on macOS and Windows, or the loader's
    ``multiprocessing_context``.  Every method yields the same batches (the dataset's shared
    state and the loader's ring travel by file descriptor to a worker that does not inherit
    them: NOTE [why shared memory here] in :mod:`shardloader.deliver.position`, :class:`~shardloader.
    transport.Ring`).  A forked worker inherits the dataset; any other gets it pickled, so a
    transform, collate or planner that cannot pickle (a lambda, a function defined inside
    another) fails only there, in torch's worker start, with a message that names no field.
    :func:`check_workers_pickle` pickles the dataset and the loader's functions once at
    construction and names the one that fails.
"""

from __future__ import annotations

import multiprocessing
import pickle
from typing import Any

from shardloader.errors import UsageError

__all__ = ["check_workers_pickle", "start_method"]


def start_method(context: Any) -> str:
    """The start method of workers made with this ``multiprocessing_context`` (None: the
    process's default, without fixing it)."""
    if isinstance(context, str):
        return context
    if context is not None:
        return str(context.get_start_method())
    chosen = multiprocessing.get_start_method(allow_none=True)
    return chosen or multiprocessing.get_all_start_methods()[0]


def check_workers_pickle(dataset: Any, context: Any, **functions: Any) -> None:
    """Raise a UsageError naming what cannot be pickled, when workers start by a method other
    than ``fork`` (NOTE [worker start methods]); ``functions``: the loader's own
    (``collate_fn``, ``worker_init_fn``) by name."""
    method = start_method(context)
    if method == "fork":
        return
    parts = [(f"the dataset's {k}", v) for k, v in vars(dataset).items()]
    parts += [(f"the loader's {k}", v) for k, v in functions.items() if v is not None]
    try:
        pickle.dumps(dataset)
        for _, value in parts[len(vars(dataset)) :]:
            pickle.dumps(value)
        return
    except Exception:  # find which part, below
        pass
    for name, value in parts:
        try:
            pickle.dumps(value)
        except Exception as err:
            raise UsageError(
                f"DataLoader workers start by {method!r} here (the default from Python 3.14 "
                f"on Linux), so each gets the dataset pickled, and {name} ({value!r:.80}) "
                f"cannot be pickled ({type(err).__name__}: {err}): define it at module level "
                "(a lambda or a function defined inside another never pickles), or pass "
                "multiprocessing_context='fork' where fork is safe (Linux, no threads or CUDA "
                "in this process)"
            ) from err
    pickle.dumps(dataset)  # the dataset as a whole: let its own error through
