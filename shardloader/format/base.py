"""What a shard format is: one :class:`Format` object holds every fact about it.

Pack, the manifest checks, the dataset, ``inspect``/``verify``, ``merge`` and ``index`` never
branch on a format's name; they look its object up in the registry
(:mod:`shardloader.format.registry`) and ask it.  A format knows how to *write* samples into a
(compressed) shard while recording each sample's offset in the uncompressed stream, how to
*stage* a stored shard into a local uncompressed random-access file, how to *read* one sample
by its index entry from a staged (or uncompressed stored) file, and how to *stream* a stored
shard front to back (verify).  It also states the sizes the planner and the manifest checks
rely on: what a sample adds to a shard's ``raw_bytes``, and the least it can add.

NOTE [bounded formats]: everything a format reads is untrusted.  ``stage`` must never write more
than ``limit`` bytes and ``iter_stored`` never decompress more than ``limit`` bytes, nor hold
a member larger than ``max_member``; past either, raise :class:`ShardError` (a decompression
bomb stops there).  Malformed input of any kind is a :class:`ShardError`, never another
exception, and a reader checks each sample against the sidecar's checksum when asked to.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Protocol

from shardloader.errors import UsageError
from shardloader.format.rows import Rows, Sample, copy_fields, read_one, read_rows

if TYPE_CHECKING:
    import numpy as np

    from shardloader.manifest import FieldInfo, SampleIndex, ShardInfo

__all__ = [
    "Format",
    "Rows",
    "Sample",
    "ScannedShard",
    "ShardReader",
    "ShardWriter",
    "WrittenShard",
    "copy_fields",
    "read_one",
    "read_rows",
]


@dataclass(frozen=True)
class WrittenShard:
    """What a writer reports on close; the pack step turns it into a ShardInfo."""

    num_samples: int
    bytes: int  # stored
    raw_bytes: int  # uncompressed: what the planner estimated and a staged copy occupies
    sha256: str  # of the stored bytes
    index: SampleIndex


@dataclass(frozen=True)
class ScannedShard:
    """What :meth:`Format.scan` found in an existing stored shard (``shardloader index``)."""

    index: SampleIndex
    fields: dict[str, int]  # extension → number of samples that have it
    raw_bytes: int  # uncompressed bytes read


class ShardWriter(Protocol):
    def add(self, key: str, fields: Mapping[str, bytes], length: int | None = None) -> None: ...

    def close(self) -> WrittenShard: ...


class ShardReader(Protocol):
    """Random access to one local uncompressed shard.  A reader may also offer
    ``read_rows(rows, into, at)``: several samples at once (see ``format/rows.py``), and
    ``keys``: its sidecar's keys, so a sample it cannot read is still named by its key."""

    def read(self, i: int) -> Sample: ...

    def close(self) -> None: ...


class Format(abc.ABC):
    """One shard format.  Subclass it, fill in the class attributes and the abstract methods,
    and register an instance with :func:`shardloader.format.registry.register_format`.

    Class attributes:

    - ``name``: what manifests and ``PackOptions(format=...)`` call it.
    - ``suffixes``: ``{compression: file suffix}`` of the shards pack writes; its keys are the
      compressions the format allows (from ``zstd``, ``gzip``, ``none``).
    - ``index_suffixes``: more suffixes ``shardloader index`` recognises (``.tgz``).
    - ``min_sample_bytes``: the least a sample adds to ``raw_bytes`` (tar: one 512-byte header;
      arrow: one byte of key).  ``end_bytes``: the least a shard holds after its samples (tar:
      one zero block).  The manifest checks refuse a shard whose ``num_samples`` cannot fit.
    - ``alignment``: samples start and end on multiples of it (tar: 512-byte blocks).
    - ``shard_overhead``: the bytes a shard pack writes holds besides its samples (tar: the
      1,024-byte end-of-archive marker): the planner adds it to each shard's estimate.
    - ``stored_is_raw``: with compression ``none`` the stored file *is* the uncompressed stream,
      so a manifest entry must have ``bytes == raw_bytes``.
    - ``indexable``: :meth:`scan` can index shards written by other tools in place.
    - ``packable``: pack writes it (Parquet: only adopted in place by ``index``).
    - ``projects``: :meth:`reader` also takes ``fields=`` and reads only those (Parquet).
    """

    name: str = ""
    suffixes: Mapping[str, str] = {}
    index_suffixes: Mapping[str, str] = {}
    min_sample_bytes: int = 1
    end_bytes: int = 0
    alignment: int = 1
    shard_overhead: int = 0
    stored_is_raw: bool = False
    indexable: bool = False
    packable: bool = True
    projects: bool = False

    @property
    def compressions(self) -> tuple[str, ...]:
        return tuple(self.suffixes)

    def check_compression(self, compression: str) -> None:
        """UsageError unless this format stores shards with ``compression``."""
        if compression not in self.suffixes:
            known = ", ".join(repr(c) for c in self.suffixes)
            raise UsageError(f"{self.name} shards compress with {known}, not {compression!r}")

    def suffix(self, compression: str) -> str:
        """File suffix of a shard: ``.tar.zst``, ``.arrow``, ..."""
        self.check_compression(compression)
        return self.suffixes[compression]

    def parse_name(self, name: str) -> tuple[str, str] | None:
        """(compression, name without the suffix) when ``name`` looks like one of our shards."""
        lower = name.lower()
        known = {**self.index_suffixes, **{s: c for c, s in self.suffixes.items()}}
        for suffix in sorted(known, key=len, reverse=True):
            if lower.endswith(suffix):
                return known[suffix], name[: -len(suffix)]
        return None

    def reads_in_place(self, compression: str) -> bool:
        """Whether a local stored shard of this compression is read as it is (not staged)."""
        return compression == "none"

    # -- writing ---------------------------------------------------------------------------
    @abc.abstractmethod
    def writer(
        self, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]
    ) -> ShardWriter:
        """A writer that fills ``fileobj`` (a checked ``compression``) and indexes each sample."""

    @abc.abstractmethod
    def sample_raw_size(self, key: str, sizes: Sequence[tuple[str, int]]) -> int:
        """Exactly what a sample of ``(extension, byte size)`` fields adds to ``raw_bytes``.

        NOTE [shard boundaries] in pack/plan.py: the planner cuts shards from these sizes,
        before anything is written, so they must equal what the writer reports.
        """

    def record_raw_sizes(self, keys: Sequence[str], ext: str, sizes: np.ndarray) -> np.ndarray:
        """:meth:`sample_raw_size` of many one-field samples at once (``keys[i]`` with field
        ``ext`` of ``sizes[i]`` bytes), as int64: the planner's path for runs of lines.  The
        default asks :meth:`sample_raw_size` per sample; a format may compute it vectorised."""
        import numpy as np

        size = self.sample_raw_size
        return np.fromiter(
            (size(k, [(ext, n)]) for k, n in zip(keys, sizes.tolist(), strict=True)),
            np.int64,
            len(keys),
        )

    # -- reading ---------------------------------------------------------------------------
    @abc.abstractmethod
    def reader(self, local_path: str, index: SampleIndex, verify: bool = True) -> ShardReader:
        """Random access to a local *uncompressed* shard (staged, or stored without
        compression); ``verify`` checks each sample against the sidecar's checksum.  Its errors
        need not name the shard: the caller does (:func:`~shardloader.errors.located`)."""

    def stage(
        self, src: BinaryIO, dst: BinaryIO, compression: str, limit: int | None = None
    ) -> int:
        """Copy a stored shard into ``dst`` as the file :meth:`reader` opens; return its bytes.

        ``limit`` (from the manifest): the most bytes the copy may take; past it, ShardError.
        The default undoes whole-stream compression (what tar and token shards use); a format
        whose compression lives inside the file (Arrow's buffers) rewrites it instead.  Its
        errors need not name the shard: the caller does.
        """
        from shardloader.format.compress import stage_stream

        return stage_stream(src, dst, compression, limit)

    @abc.abstractmethod
    def iter_stored(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        limit: int | None = None,
        max_member: int | None = None,
    ) -> Iterator[Sample]:
        """Stream every sample of a stored shard front to back, checking its structure.

        ``limit`` bounds the uncompressed bytes, ``max_member`` any one field's.
        """

    def iter_checked(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        index: SampleIndex | None,
        limit: int | None = None,
        max_member: int | None = None,
    ) -> Iterator[tuple[Sample, int | None]]:
        """:meth:`iter_stored`, each sample with the checksum its reader checks against the
        sidecar ``index`` (``verify`` compares them); None (the default): not checked."""
        for sample in self.iter_stored(src, compression, where, limit, max_member):
            yield sample, None

    def scan(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        max_member: int | None,
        length_fields: Sequence[str] = (),
    ) -> ScannedShard:
        """Index a stored shard another tool wrote (formats with ``indexable = True``).

        A sample's length is the size of its first field named in ``length_fields``.
        """
        raise UsageError(
            f"{where}: {self.name} shards cannot be indexed in place; convert them with "
            "`shardloader pack`"
        )

    # -- what the manifest checks ask --------------------------------------------------------
    def staged_bound(self, info: ShardInfo, num_fields: int) -> int:
        """Most bytes a staged copy of this shard may take (default: its ``raw_bytes``)."""
        return info.raw_bytes

    def entry_problem(
        self, num_samples: int, stored: int, raw: int, compression: str
    ) -> tuple[str, str] | None:
        """(key, problem) of a manifest entry whose sizes cannot be true, or None."""
        if self.stored_is_raw and compression == "none" and raw != stored:
            return "raw_bytes", (
                f"{raw:,} differs from bytes {stored:,} for an uncompressed {self.name} shard"
            )
        most = max(raw - self.end_bytes, 0) // self.min_sample_bytes
        if num_samples and num_samples > most:
            return "num_samples", (
                f"{num_samples:,} samples cannot fit in {raw:,} uncompressed bytes (a "
                f"{self.name} sample takes at least {self.min_sample_bytes} "
                f"byte{'s' if self.min_sample_bytes != 1 else ''})"
            )
        return None

    def index_problem(self, index: SampleIndex, info: ShardInfo) -> str | None:
        """Why a sidecar's offsets and sizes cannot belong to this shard, or None.

        Default, for formats whose offsets are byte positions in the uncompressed shard: every
        sample lies inside ``raw_bytes`` less ``end_bytes``, takes at least ``min_sample_bytes``
        and starts and ends on ``alignment``.  Counts, negative values and keys are checked by
        the caller.
        """
        if not len(index):
            return None
        offsets, sizes, step = index.offsets, index.sizes, self.alignment
        ends = offsets + sizes
        bad = (ends > info.raw_bytes - self.end_bytes) | (sizes < self.min_sample_bytes)
        if step > 1:
            bad |= (offsets % step != 0) | (sizes % step != 0)
        if not bad.any():
            return None
        i = int(bad.argmax())
        off = f" or off its {step}-byte blocks" if step > 1 else ""
        return (
            f"the sample index puts sample {index.keys[i]!r} at bytes {int(offsets[i])}.."
            f"{int(ends[i])}, outside the {info.raw_bytes:,}-byte {self.name} shard{off}; the "
            "sidecar does not match the shard"
        )

    def __repr__(self) -> str:
        return f"<shard format {self.name!r}: {', '.join(self.suffixes)}>"


class CheckedFormat(Format):
    """A format whose :meth:`iter_checked` is its stream (the built-ins: each sample's checksum
    costs little beside parsing it); :meth:`iter_stored` is that stream, checksums dropped."""

    def iter_stored(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        limit: int | None = None,
        max_member: int | None = None,
    ) -> Iterator[Sample]:
        for sample, _ in self.iter_checked(src, compression, where, None, limit, max_member):
            yield sample
