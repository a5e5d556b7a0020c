"""Run-time skips: the one part of the ledger written while reading (NOTE [the ledger comes
from the plan] in :mod:`shardloader.plan.ledger`).

A sample ``on_error="skip"`` replaces is appended by the worker that met it to a small
JSON-lines file of its rank (:class:`SkipLog`); :func:`merge_skips` reads every rank's file
back into one sorted list of :class:`~shardloader.plan.ledger.SkipRecord`.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardloader.errors import UsageError
from shardloader.plan.ledger import SkipRecord

if TYPE_CHECKING:
    from shardloader.plan.split import Place

__all__ = ["SkipLog", "merge_skips"]


@dataclass(frozen=True)
class SkipLog:
    """Appends run-time skips to ``directory/skips-rank<R>.jsonl`` (one small file per rank).

    Picklable (a folder name), so it travels into DataLoader workers; every worker of a rank
    appends to its rank's file with one ``O_APPEND`` write per line, which the OS keeps whole
    on a local file system.  :func:`merge_skips` reads them back.
    """

    directory: str

    def path(self, rank: int) -> str:
        return os.path.join(self.directory, f"skips-rank{rank:05d}.jsonl")

    def record(self, epoch: int, place: Place, sample: int, key: str, err: BaseException) -> None:
        line = {
            "epoch": int(epoch),
            "sample": int(sample),
            "key": key,
            "rank": place.rank,
            "worker": place.worker,
            "reason": f"{type(err).__name__}: {err}",
        }
        os.makedirs(self.directory, exist_ok=True)
        data = (json.dumps(line) + "\n").encode()
        fd = os.open(self.path(place.rank), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def merge_skips(directory: str, epoch: int | None = None) -> list[SkipRecord]:
    """Every rank's run-time skips under ``directory`` (of ``epoch``, or all), one per
    (epoch, sample), sorted by epoch then sample id: the same list whichever rank reads it."""
    records: list[SkipRecord] = []
    for path in sorted(glob.glob(os.path.join(directory, "skips-rank*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = SkipRecord(**json.loads(line))
                except (TypeError, ValueError) as err:
                    raise UsageError(f"{path}:{number}: not a skip record ({err})") from err
                if epoch is None or record.epoch == epoch:
                    records.append(record)
    seen: dict[tuple[int, int], SkipRecord] = {}  # the first rank and worker's of each
    for record in sorted(records, key=lambda r: (r.epoch, r.sample, r.rank, r.worker)):
        seen.setdefault((record.epoch, record.sample), record)
    return list(seen.values())
