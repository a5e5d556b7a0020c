"""A mixture's weight schedule as the shared array holds it and as a saved state gives it
(NOTE [mixture state] in :mod:`shardloader.mixture`): pure encoding and checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardloader.errors import ResumeError, UsageError
from shardloader.plan.elastic import flat_table, read_table

__all__ = ["Entries", "read_entries", "write_entries", "saved_entries"]

Entries = tuple[tuple[int, tuple[int, ...]], ...]  # (from epoch, integer parts)


def read_entries(values: Sequence[int], k: int) -> Entries:
    """The schedule of ``k`` sources from the shared array's ``values``: a count, then per
    entry its first epoch and ``k`` parts."""
    return tuple((row[0], row[1:]) for row in read_table(values, 1 + k))


def write_entries(
    control: Any, k: int, entries: Sequence[tuple[int, tuple[int, ...]]], most: int
) -> None:
    """Write ``entries`` into the shared array ``control`` (:func:`read_entries`' layout)."""
    if len(entries) > most:
        raise UsageError(f"a mixture holds at most {most} weight changes")
    flat = flat_table([(start, *parts) for start, parts in entries], 1 + k, most)
    # the count last: a worker reading meanwhile sees the old schedule or the whole new one
    control.update(dict(enumerate(flat[1:], start=1)) | {0: flat[0]})


def saved_entries(saved: Any, names: Sequence[str]) -> list[tuple[int, tuple[int, ...]]]:
    """The schedule of a saved state's ``mixture`` entry, checked against the sources."""
    if not isinstance(saved, Mapping):
        raise ResumeError("the saved state has no 'mixture' entry: it is not a Mixture's")
    if list(saved.get("sources", ())) != list(names):
        raise ResumeError(
            f"saved mixture sources {saved.get('sources')!r} are not this mixture's "
            f"{list(names)}: pass the same sources, in the same order"
        )
    malformed = f"saved mixture schedule {saved.get('schedule')!r} is malformed"
    try:
        entries = [(int(e), tuple(int(x) for x in p)) for e, p in saved["schedule"]]
    except (KeyError, TypeError, ValueError) as err:
        raise ResumeError(malformed) from err
    if (
        not entries
        or entries[0][0] != 0
        or any(len(p) != len(names) or sum(p) <= 0 or min(p) < 0 for _, p in entries)
        or any(a[0] >= b[0] for a, b in zip(entries, entries[1:], strict=False))
    ):
        raise ResumeError(malformed)
    return entries
