"""Where every field of every sample lies in an uncompressed tar shard, found once per shard.

A tar member is a 512-byte header (name, octal size, type) and its data.  Parsing headers one
sample at a time in Python cost about half of reading a small sample, so a reader derives the
whole shard's layout when it opens it, with numpy over all samples at once: round ``r`` reads
the ``r``-th header of every sample that has one.  Afterwards a sample's field is two array
lookups.

Only the common case is derived: plain ustar members (type ``0``, an octal size, no name prefix)
named ``<key>.<ext>``, laid end to end over exactly the sample's byte range in the sidecar.  A
sample that differs in any way (pax or GNU long-name records, an extension longer than
:data:`MAX_EXT` bytes, a repeated extension, a header past the end of the file) is marked
irregular and read by the general parser, which also gives the precise error.

NOTE [what the layout trusts]: with per-sample checksums checked (the default), each sample's
bytes, headers included, are checked against the XXH3 the writer recorded next to its key
before any field is used, so the name in its headers is the writer's ``<key>.<ext>``: the layout
then takes the extension after ``len(key) + 1`` bytes without comparing the key.  Without that
check (``verify_samples=False``, or a sidecar without checksums) it compares each name's key
with the sidecar's, vectorised as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EMPTY", "MAX_EXT", "TarLayout", "derive_layout"]

BLOCK = 512
# The extension of the one member of a sample that has no fields (a table row of nulls): an
# empty ``<key>.__empty__``, so every tar reader (webdataset too: it passes ``__``-names through
# undecoded) sees the sample; shardloader's readers give it no field.
EMPTY = "__empty__"
MAX_EXT = 32  # longest extension (bytes) the layout derives; longer ones take the general parser
_NAME = 100  # bytes of the ustar name field
_SIZE_AT, _SIZE_DIGITS = 124, 11
_TYPE_AT = 156
_PREFIX_AT = 345
_MAX_MEMBERS = 64  # members per sample the layout follows
_POW8 = 8 ** np.arange(_SIZE_DIGITS - 1, -1, -1, dtype=np.int64)


@dataclass(frozen=True)
class TarLayout:
    """``fields``: extension → (data start, data stop) of that member in every sample, -1 where
    a sample has no such member; ``regular``: the samples the layout describes completely."""

    fields: dict[str, tuple[np.ndarray, np.ndarray]]
    regular: np.ndarray


def derive_layout(
    buf: np.ndarray,
    offsets: np.ndarray,
    sizes: np.ndarray,
    klen: np.ndarray,
    keys: tuple[np.ndarray, np.ndarray] | None = None,
) -> TarLayout:
    """The layout of the samples at ``offsets``/``sizes`` in ``buf`` (the shard's bytes as
    uint8) whose keys are ``klen`` bytes long; ``keys`` (each key's start in ``joined``, and
    ``joined``: :func:`shardloader.format.keys.key_lengths`) makes it compare every member name's
    key with the sidecar's (NOTE above).

    Samples start on 512-byte blocks (the sidecar checks say so), and so does every member
    of a regular sample, so headers are rows of ``buf`` viewed as blocks: each round copies
    the first 346 bytes (name, size, type, name prefix) of one header per sample.
    """
    n = len(offsets)
    offsets = np.asarray(offsets, np.int64)
    ends = offsets + np.asarray(sizes, np.int64)
    blocks = buf[: len(buf) // BLOCK * BLOCK].reshape(-1, BLOCK)
    regular = (
        (offsets >= 0)
        & (ends - offsets >= BLOCK)
        & (ends <= len(blocks) * BLOCK)
        & (offsets % BLOCK == 0)
        & (ends % BLOCK == 0)
        & (klen + 2 <= _NAME)  # room for "<key>.<ext>" in the name field
    )
    fields: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    rows = np.flatnonzero(regular)
    pos = offsets[rows]
    for _ in range(_MAX_MEMBERS):
        if rows.size == 0:
            break
        m = len(rows)
        head = blocks[pos >> 9, : _PREFIX_AT + 1]
        kl = klen[rows]
        flag = head[:, _TYPE_AT]
        ok = ((flag == 48) | (flag == 0)) & (head[:, _PREFIX_AT] == 0)  # a file, no prefix
        digits = head[:, _SIZE_AT : _SIZE_AT + _SIZE_DIGITS] - np.uint8(48)
        ok &= (digits <= 7).all(axis=1)
        size = digits.astype(np.int64) @ _POW8
        nul = head[:, :_NAME] == 0
        length = np.where(nul.any(axis=1), nul.argmax(axis=1), _NAME)
        line = np.arange(m)
        ok &= head[line, kl] == 46  # "." after the key
        ext_len = length - kl - 1
        ok &= (ext_len > 0) & (ext_len <= MAX_EXT)
        if keys is not None:
            ok &= _names_have_keys(head, kl, keys[0][rows], keys[1])
        ext_len = np.where(ok, ext_len, 0)
        width = max(int(ext_len.max()), 1)
        j = np.arange(width)
        ext = head[line[:, None], np.minimum(kl[:, None] + 1 + j, _NAME - 1)]
        ext[j >= ext_len[:, None]] = 0
        ok &= (ext != 47).all(axis=1)  # no "/" in an extension
        start = pos + BLOCK
        stop = start + size
        nxt = start + ((size + BLOCK - 1) & ~(BLOCK - 1))
        end = ends[rows]
        ok &= nxt <= end
        good, start, stop, nxt, end = rows[ok], start[ok], stop[ok], nxt[ok], end[ok]
        for name, members in _group(ext[ok]).items():
            if name == EMPTY:  # the marker of a sample with no fields: no field itself
                continue
            where = good if members is None else good[members]
            column = fields.get(name)
            if column is None:
                column = fields[name] = (np.full(n, -1, np.int64), np.full(n, -1, np.int64))
            repeated = column[0][where] >= 0
            if repeated.any():
                regular[where[repeated]] = False  # a repeated extension
            column[0][where] = start if members is None else start[members]
            column[1][where] = stop if members is None else stop[members]
        if not ok.all():
            regular[rows[~ok]] = False
        more = nxt < end
        rows, pos = good[more], nxt[more]
    regular[rows] = False  # more members than followed
    return TarLayout(fields, regular)


def _names_have_keys(
    head: np.ndarray, klen: np.ndarray, kstart: np.ndarray, joined: np.ndarray
) -> np.ndarray:
    """Whether each name starts with its sample's key (compared byte by byte)."""
    width = int(klen.max())
    j = np.arange(width)
    expected = joined[np.minimum(kstart[:, None] + j, len(joined) - 1)]
    return ((head[:, :width] == expected) | (j >= klen[:, None])).all(axis=1)  # type: ignore[no-any-return]


def _group(ext: np.ndarray) -> dict[str, np.ndarray | None]:
    """Extension → positions of the rows that have it (None: all of them, the common case)."""
    if len(ext) == 0:
        return {}
    as_bytes = np.ascontiguousarray(ext).view(f"S{ext.shape[1]}").ravel()
    if (as_bytes == as_bytes[0]).all():
        return {_name(as_bytes[0]): None}
    names, inverse = np.unique(as_bytes, return_inverse=True)
    return {_name(v): np.flatnonzero(inverse == i) for i, v in enumerate(names)}


def _name(raw: bytes) -> str:
    return bytes(raw).decode("utf-8", "surrogateescape")
