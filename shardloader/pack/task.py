"""What crosses into a pack worker and back: the run's spec, one shard's task, its result.

Why a module of its own: everything a task needs crosses the process boundary (a local worker,
or a Ray task on another machine) as these plain frozen dataclasses: no open files, no lambdas.
Both sides import them: the orchestrator (pack/run.py) and the worker that writes a shard
(pack/write.py, which fills it through pack/fill.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardloader.format.registry import format_module
from shardloader.manifest import FieldInfo, ShardInfo
from shardloader.pack.options import PackOptions
from shardloader.pack.plan import ShardPlan
from shardloader.pack.refs import TextRule
from shardloader.storage.store import Store

__all__ = ["ShardResult", "ShardTask", "WriteSpec"]


@dataclass(frozen=True)
class WriteSpec:
    """What every shard of one run shares (picklable)."""

    src: Store  # the input (its files' URLs come with each InputFile)
    out: Store  # final location; shards are checked there on resume
    staging: str  # local folder for temporary shards (OUT itself when OUT is local)
    run_id: str
    # the run's options: format, compression, validate, on_error, resume, max_sample_size
    options: PackOptions
    fields: Mapping[str, FieldInfo]
    options_digest: str
    text: TextRule | None = None
    tokenizer: str | None = None  # local path of a Hugging Face tokenizers JSON file
    # where the format is defined: a worker process imports it (a third-party format)
    format_module: str = ""

    def __post_init__(self) -> None:
        if not self.format_module:
            object.__setattr__(self, "format_module", format_module(self.options.format))

    def input(self, url: str) -> Store:
        """The store of an input file's URL, with the source's options and policy."""
        return Store(url, self.src.options, self.src.retry)


@dataclass(frozen=True)
class ShardTask:
    plan: ShardPlan
    name: str
    index_name: str


@dataclass(frozen=True)
class ShardResult:
    number: int
    info: ShardInfo  # the manifest's entry
    bytes_in: int
    skips: tuple[dict[str, Any], ...]
    field_samples: Mapping[str, int]  # samples holding each member extension
    temp: str | None = None  # local temporary shard to move into place; None when kept
    sidecar: bytes | None = None  # sidecar to write; None when kept
    kept: bool = False
