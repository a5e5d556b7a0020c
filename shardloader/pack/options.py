"""What ``pack`` takes and gives: its options, its progress ticks and its report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardloader.errors import UsageError
from shardloader.format.registry import check_pack_format
from shardloader.manifest import Manifest
from shardloader.pack.layouts.registry import AUTO, layout_names
from shardloader.storage.retry import RetryPolicy
from shardloader.storage.store import Store

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "PACKER_VERSION",
    "PackOptions",
    "PackProgress",
    "PackReport",
    "auto_shard_size",
]

PACKER_VERSION = 1  # bump when the same input and options would give different shard bytes
DEFAULT_SHARD_SIZE = 128 << 20
MIN_AUTO_SHARD_SIZE = 16 << 20
AUTO_SHARDS = 8  # an input under 8 default shards is cut into about this many


def auto_shard_size(total_bytes: int) -> int:
    """``--shard-size auto``: 128 MiB, or for an input of less than 8 such shards about an
    eighth of it (whole MiB, at least 16 MiB), so pack workers share the work and progress
    moves shard by shard.  A function of the input alone: the shards are the same bytes
    whatever ``--workers`` is."""
    if total_bytes >= AUTO_SHARDS * DEFAULT_SHARD_SIZE:
        return DEFAULT_SHARD_SIZE
    mib = -(-total_bytes // AUTO_SHARDS // (1 << 20))  # rounded up to a whole MiB
    return max(MIN_AUTO_SHARD_SIZE, mib << 20)


@dataclass(frozen=True)
class PackOptions:
    """How to pack; mirrors ``shardloader pack`` options (see ``--help``)."""

    format: str = "tar"  # tar | arrow | a registered format
    compression: str = "zstd"  # zstd | gzip | none (arrow: zstd | none)
    # uncompressed bytes per shard; 0: no limit; None: auto (auto_shard_size of the input)
    shard_size: int | None = None
    max_samples: int | None = None  # samples per shard
    # bytes of one sample's input (its files, or its line); larger is a bad sample, refused
    # or skipped (--on-error) before it is read: what one sample may cost a pack worker
    max_sample_size: int | None = None
    layout: str = AUTO  # auto | a registered layout (shardloader.pack.layouts)
    on_error: str = "fail"  # fail | skip
    validate: bool = False  # decode images to check them
    tokenizer: str | None = None  # local tokenizers JSON: adds a ``tokens`` field
    text_field: str = "text"
    # pre-tokenized input: the column or JSON key holding each record's token ids, laid out
    # as the ``tokens`` field without a tokenizer (pack/token_ids.py)
    token_field: str | None = None
    vocab_size: int | None = None  # --token-field: ids are below it (default: largest id + 1)
    workers: int = 1  # local: writer processes; ray: shard writes in flight at once
    executor: str = "local"  # local | ray (pip install 'shardloader[ray]')
    address: str | None = None  # ray: the cluster (default: RAY_ADDRESS, else a local Ray)
    num_parts: int = 1
    part: int = 0
    resume: bool = False
    overwrite: bool = False
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # --alias image=jpg,png
    # --labels: a filename,label CSV or a list of labels (one a line, sorted file order) for a
    # flat image folder: each sample gets a ``cls`` field (shardloader.pack.labels)
    labels: str | None = None
    # Retries and timeouts of the main process's storage calls (listing, record reads, uploads,
    # manifest); they never change the shard bytes, so the resume digest leaves them out.
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        check_pack_format(self.format, self.compression)  # the format registry knows
        if self.shard_size is not None and self.shard_size < 0:
            raise UsageError(f"--shard-size {self.shard_size} must be >= 0 (0: no limit)")
        if self.max_samples is not None and self.max_samples < 1:
            raise UsageError(f"--max-samples {self.max_samples} must be >= 1")
        if self.max_sample_size is not None and self.max_sample_size < 1:
            raise UsageError(f"--max-sample-size {self.max_sample_size} must be >= 1 byte")
        if self.layout not in layout_names(auto=True):
            raise UsageError(
                f"--layout {self.layout!r}: choose one of {', '.join(layout_names(auto=True))}"
            )
        if self.on_error not in ("fail", "skip"):
            raise UsageError(f"--on-error {self.on_error!r}: choose 'fail' or 'skip'")
        if self.workers < 1:
            raise UsageError(f"--workers {self.workers} must be >= 1")
        if self.executor not in ("local", "ray"):
            raise UsageError(f"--executor {self.executor!r}: choose 'local' or 'ray'")
        if self.address is not None and self.executor != "ray":
            raise UsageError("--address names a Ray cluster: it goes with --executor ray")
        if self.num_parts < 1 or not 0 <= self.part < self.num_parts:
            raise UsageError(
                f"--part {self.part} --num-parts {self.num_parts}: need 0 <= part < num_parts"
            )
        if self.resume and self.overwrite:
            raise UsageError(
                "--resume keeps finished shards and --overwrite discards them: pick one"
            )
        if not self.text_field:
            raise UsageError("--text-field must not be empty")
        if self.token_field is not None:
            if not self.token_field:
                raise UsageError("--token-field must not be empty")
            if self.tokenizer is not None:
                raise UsageError(
                    "--token-field takes token ids the input already holds and --tokenizer "
                    "makes them from text: pass one of them"
                )
        if self.vocab_size is not None:
            if self.token_field is None:
                raise UsageError(
                    "--vocab-size goes with --token-field (a tokenizer file knows its own "
                    "vocabulary size)"
                )
            if isinstance(self.vocab_size, bool) or not 1 <= self.vocab_size <= 1 << 32:
                raise UsageError(f"--vocab-size {self.vocab_size} must be between 1 and 2**32")
        if not isinstance(self.retry, RetryPolicy):
            raise UsageError(f"PackOptions.retry must be a RetryPolicy, got {self.retry!r}")

    def store(self, url: str) -> Store:
        """The :class:`~shardloader.storage.Store` of ``url`` (SRC, OUT) with these storage
        options and this retry policy: what every stage of the pack takes."""
        return Store(url, self.storage_options, self.retry)


@dataclass(frozen=True)
class PackProgress:
    """Running totals, reported after each finished shard."""

    samples: int
    shards: int
    bytes_in: int
    bytes_out: int
    total_bytes: int | None  # input bytes expected (None when unknown)
    seconds: float


@dataclass(frozen=True)
class PackReport:
    """What a pack did; the CLI prints it as the summary."""

    out: str
    manifest: Manifest
    samples: int
    shards: int
    kept_shards: int  # reused by --resume
    skipped: int
    bytes_in: int  # input bytes packed (file sizes, record bytes)
    bytes_out: int  # stored shard bytes
    raw_bytes: int  # uncompressed shard bytes
    seconds: float
    skip_report: str | None  # URL of the skip report, if anything was skipped
    # what the listing of SRC left out: (path relative to SRC, why): hidden and system files
    # (Thumbs.db, .DS_Store, desktop.ini), symlink loops
    ignored: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()  # what pack decided for you, and advice (the CLI prints them)

    @property
    def ratio(self) -> float:
        """Input bytes per stored byte."""
        return self.bytes_in / self.bytes_out if self.bytes_out else 0.0

    @property
    def compression_ratio(self) -> float:
        """Uncompressed shard bytes per stored byte: the ratio ``inspect`` reports."""
        return self.raw_bytes / self.bytes_out if self.bytes_out else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes_in / 1e6 / self.seconds if self.seconds > 0 else 0.0
