"""A batch's samples as the readers hand them over: :class:`Rows`, filled shard by shard.

Why a module of its own: this is the read path's side of a format (``format/base.py`` says what
a format is); the readers, the shard set and the pass all pass a batch's :class:`Rows` along.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from shardloader.errors import ChecksumError, ShardError, ShardloaderError, StorageError

if TYPE_CHECKING:
    import numpy as np

    from shardloader.format.base import ShardReader

__all__ = ["Rows", "Sample", "copy_fields", "damaged", "read_each", "read_one", "read_rows"]

Sample = tuple[str, dict[str, bytes]]  # (key, {extension: raw bytes})


class Rows:
    """The samples of a batch, read shard by shard (:func:`read_rows`), then in batch order.

    A reader hands over what it read for some positions of the batch with :meth:`add` (their
    keys, and one list per field in the same order) and each sample it could not read with
    :meth:`fail`; every position gets exactly one of the two.  Afterwards ``keys`` (a list),
    ``fields`` (field name → one entry per sample: its bytes, or None where the sample lacks
    the field or could not be read) and ``errors`` (position → its :class:`ShardError` or
    :class:`StorageError`) are the batch in order (bytes-like: the built-in readers give
    ``bytes``).  A sample that could not be read keeps the key its sidecar gives it (``""``
    where none is known), so a skip record names it as its error does.

    Putting several shards' samples back in order is done with C-level list operations, not a
    Python loop per sample: a reader's parts are appended as they come, and ordered once.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.errors: dict[int, ShardloaderError] = {}
        self._failed_keys: dict[int, str] = {}  # position -> the sidecar's key of a failure
        self._parts: list[tuple[Sequence[int], list[str], dict[str, list[Any]]]] = []
        self._ordered: tuple[list[str], dict[str, list[Any]]] | None = None

    def add(self, at: Sequence[int], keys: list[str], fields: dict[str, list[Any]]) -> None:
        """Samples for positions ``at``: their keys, and per field one entry each."""
        self._parts.append((at, keys, fields))
        self._ordered = None

    def fail(self, pos: int, err: ShardloaderError, key: str = "") -> None:
        """Sample ``pos`` (sidecar key ``key``, when known) could not be read, because of
        ``err``."""
        self.errors[pos] = err
        if key:
            self._failed_keys[pos] = key
        self._ordered = None

    def done(self, pos: int) -> bool:
        """Whether position ``pos`` was added or failed already."""
        return pos in self.errors or any(pos in at for at, _, _ in self._parts)

    @property
    def keys(self) -> list[str]:
        return self._order()[0]

    @property
    def fields(self) -> dict[str, list[Any]]:
        return self._order()[1]

    def split(self, sizes: Sequence[int]) -> list[Rows]:
        """Consecutive pieces of ``sizes`` samples each (several batches read at once)."""
        keys, fields = self._order()
        out, start = [], 0
        for size in sizes:
            stop = start + size
            piece = Rows(size)
            piece._ordered = keys[start:stop], {n: c[start:stop] for n, c in fields.items()}
            piece.errors = {p - start: e for p, e in self.errors.items() if start <= p < stop}
            out.append(piece)
            start = stop
        return out

    def _order(self) -> tuple[list[str], dict[str, list[Any]]]:
        if self._ordered is not None:
            return self._ordered
        parts, n = self._parts, self.n
        names = list(dict.fromkeys(name for _, _, fields in parts for name in fields))
        if len(parts) == 1 and not self.errors and len(parts[0][0]) == n:
            at, keys, fields = parts[0]
            if list(at) == list(range(n)):
                self._ordered = keys, {name: fields[name] for name in names}
                return self._ordered
        where = [pos for at, _, _ in parts for pos in at] + list(self.errors)
        failed = [self._failed_keys.get(pos, "") for pos in self.errors]
        keys = [key for _, ks, _ in parts for key in ks] + failed
        columns = {}
        for name in names:
            column: list[Any] = []
            for at, _, fields in parts:
                column.extend(fields.get(name) or [None] * len(at))
            columns[name] = column + [None] * len(self.errors)
        if len(where) != n:
            raise RuntimeError(f"readers filled {len(where)} positions of a batch of {n}")
        order = sorted(range(n), key=where.__getitem__)
        self._ordered = (
            list(map(keys.__getitem__, order)),
            {name: list(map(column.__getitem__, order)) for name, column in columns.items()},
        )
        return self._ordered


def read_rows(
    reader: ShardReader, rows: Sequence[int] | np.ndarray, into: Rows, at: Sequence[int]
) -> None:
    """Read samples ``rows`` of ``reader`` for positions ``at`` of ``into`` (a batch's samples
    from several shards are put back in batch order): through the reader's own ``read_rows``
    when it has one (the built-in formats read a batch in one pass over precomputed field
    positions), else one ``read`` per row.  A row's ShardError or StorageError goes into
    ``into.errors``; any other error propagates."""
    fast = getattr(reader, "read_rows", None)
    if fast is not None:
        fast(rows, into, at)
        return
    keys = getattr(reader, "keys", None)
    read_each(reader.read, zip(at, map(int, rows), strict=True), into, keys)


def read_each(
    read: Callable[[int], Sample],
    rows: Iterable[tuple[int, int]],
    into: Rows,
    keys: Sequence[str] | None,
) -> None:
    """Samples ``(position, row)`` read one by one by ``read`` and added together: one part of
    ``into`` for all of them (a part per sample costs the batch's ordering more).  A row's
    ShardError or StorageError goes into ``into.errors``, named by its key in ``keys`` (the
    sidecar's, when known)."""
    got: list[tuple[int, Sample]] = []
    for pos, i in rows:
        try:
            got.append((pos, read(i)))
        except (ShardError, StorageError) as err:
            into.fail(pos, err, "" if keys is None else str(keys[i]))
    if got:
        names = dict.fromkeys(name for _, (_, fields) in got for name in fields)
        into.add(
            [pos for pos, _ in got],
            [key for _, (key, _) in got],
            {name: [fields.get(name) for _, (_, fields) in got] for name in names},
        )


def damaged(sample: str) -> ChecksumError:
    """The error of a sample that does not match its sidecar checksum (``sample`` names it and
    says how), with the remedy every format's reader gives."""
    return ChecksumError(
        f"{sample}: the shard is damaged; `shardloader verify` checks the whole dataset "
        "(ReadOptions(verify_samples=False) skips this per-sample check)"
    )


def read_one(reader: Any, i: int) -> Sample:
    """Sample ``i`` of a reader that reads through its ``read_rows`` alone (Arrow, Parquet):
    the row's error raised, its absent fields left out."""
    rows = Rows(1)
    reader.read_rows([i], rows, [0])
    if rows.errors:
        raise rows.errors[0]
    return rows.keys[0], {n: c[0] for n, c in rows.fields.items() if c[0] is not None}


def copy_fields(
    get: Callable[[slice], Any],
    names: Sequence[str],
    picked: np.ndarray,
    first: int,
    all_fields: bool,
) -> dict[str, list[Any]]:
    """Each field's values for the rows of a row table: ``picked[:, first + 2 f]`` and the
    next column are field ``f``'s (start, stop) in the file (start -1: absent, None there),
    each value ``get(slice(start, stop))``, made by C-level ``map`` when every row has it.
    A field no row has is all None with ``all_fields`` (a fixed schema), else left out.
    Shared by the built-in readers' ``read_rows``."""
    fields: dict[str, list[Any]] = {}
    for f, name in enumerate(names):
        starts, stops = picked[:, first + 2 * f], picked[:, first + 1 + 2 * f]
        there = starts >= 0
        if there.all():
            fields[name] = list(map(get, map(slice, starts.tolist(), stops.tolist())))
        elif there.any():
            fields[name] = [
                get(slice(a, b)) if a >= 0 else None
                for a, b in zip(starts.tolist(), stops.tolist(), strict=True)
            ]
        elif all_fields:
            fields[name] = [None] * len(picked)
    return fields
