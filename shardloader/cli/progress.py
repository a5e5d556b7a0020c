"""Progress bars that keep moving: tqdm on stderr, refreshed every second by a small thread.

tqdm redraws only when it is updated, so while one large shard is written (or verified) its
elapsed time froze and the bar looked dead.  :func:`progress_bar` redraws it on a clock as
well, and shows nothing unless stderr is a terminal and ``--quiet`` is off.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

__all__ = ["counter", "progress_bar"]


@contextmanager
def progress_bar(
    show: bool, *, interval: float = 1.0, file: IO[str] | None = None, **tqdm_args: Any
) -> Iterator[Any]:
    """A tqdm bar (or None when ``show`` is false) redrawn every ``interval`` seconds until
    the block ends; ``tqdm_args`` go to tqdm."""
    if not show:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(file=file or sys.stderr, dynamic_ncols=True, **tqdm_args)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(interval):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="shardloader-progress", daemon=True)
    ticker.start()
    try:
        yield bar
    finally:
        stop.set()
        ticker.join()
        bar.close()


def counter(bar: Any) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback that moves ``bar`` (None: does nothing)."""

    def on_progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    return on_progress
