"""Control values a dataset shares with its DataLoader workers (epoch, resume position, ...).

A dataset's epoch, resume position, rank and world (and a mixture's weight schedule, a resume's
reshape history) are set in the main process but read by workers that torch may keep for many
epochs; this is the one small container that carries them across.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from collections.abc import Mapping
from typing import Any

__all__ = ["Control"]


class Control:
    """Epoch, resume position, rank and world, readable by DataLoader workers.

    NOTE [why shared memory here]: with ``persistent_workers=True`` torch keeps the dataset
    copy the workers got at start, so ``set_epoch`` in the main process would never reach them.
    Four int64s in an anonymous shared array (inherited by workers, gone with the processes,
    nothing named to leak) carry it.  Outside process start-up the dataset pickles a snapshot.
    """

    def __init__(self, values: list[int]) -> None:
        self.array: Any = multiprocessing.RawArray("q", values)

    def get(self) -> list[int]:
        return list(self.array)

    def set(self, index: int, value: int) -> None:
        self.array[index] = value

    def update(self, values: Mapping[int, int]) -> None:
        """Set several values at once: ``{index: value}``."""
        for index, value in values.items():
            self.array[index] = value

    def __getstate__(self) -> dict[str, Any]:
        if multiprocessing.context.get_spawning_popen() is not None:
            return {"array": self.array}
        return {"values": list(self.array)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "array" in state:
            self.array = state["array"]
        else:
            self.array = multiprocessing.RawArray("q", state["values"])
