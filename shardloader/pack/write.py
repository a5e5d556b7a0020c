"""Write one planned shard: read its files, check its fields, write a temporary shard.

Runs in a worker process (or inline with ``--workers 1``).  Everything a task needs crosses the
process boundary as plain frozen dataclasses (:class:`WriteSpec`, :class:`ShardTask`): no open
files, no lambdas.  The worker writes ``.<name>.tmp-<run id>`` and fsyncs it; the main process
renames it to its final name (or uploads it), writes the sidecar, and the manifest last.

A resumed run keeps the finished shards that still match their plan and checksum (NOTE [resume]
in pack/resume.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np

from shardloader.codecs import check_field
from shardloader.errors import InputError, ShardloaderError, StorageError
from shardloader.format.base import WrittenShard
from shardloader.format.registry import format_module, get_format
from shardloader.keys import unsafe_key_reason
from shardloader.manifest import FieldInfo, SampleIndex
from shardloader.pack.discover import TextRule
from shardloader.pack.layouts.lines import read_run
from shardloader.pack.plan import ShardPlan
from shardloader.pack.refs import FileRef, LineRun, SampleRef
from shardloader.pack.resume import plan_digest, sidecar_bytes, sidecar_meta
from shardloader.storage.store import Store

__all__ = [
    "WriteSpec",
    "ShardTask",
    "ShardResult",
    "write_shard",
    "place_shard",
    "write_and_place",
    "plan_digest",
    "sidecar_bytes",
    "sidecar_meta",
    "worker_init",
    "temp_name",
]

log = logging.getLogger(__name__)

_HASH_CHUNK = 4 << 20


@dataclass(frozen=True)
class WriteSpec:
    """What every shard of one run shares (picklable)."""

    src: Store  # the input (its files' URLs come with each FileRef)
    out: Store  # final location; shards are checked there on resume
    staging: str  # local folder for temporary shards (OUT itself when OUT is local)
    run_id: str
    fmt: str
    compression: str
    fields: Mapping[str, FieldInfo]
    options_digest: str
    validate: bool = False
    on_error: str = "fail"
    text: TextRule | None = None
    tokenizer: str | None = None  # local path of a Hugging Face tokenizers JSON file
    resume: bool = False
    # where the format is defined: a worker process imports it (a third-party format)
    format_module: str = ""

    def __post_init__(self) -> None:
        if not self.format_module:
            object.__setattr__(self, "format_module", format_module(self.fmt))

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
    name: str
    index_name: str
    num_samples: int
    stored_bytes: int
    raw_bytes: int
    sha256: str
    index_sha256: str
    bytes_in: int
    skips: tuple[dict[str, Any], ...]
    temp: str | None = None  # local temporary shard to move into place; None when kept
    sidecar: bytes | None = None  # sidecar to write; None when kept
    kept: bool = False


def temp_name(spec: WriteSpec, name: str) -> str:
    return os.path.join(spec.staging, f".{name}.tmp-{spec.run_id}")


# -- worker process -------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:  # no procfs (macOS): the kill() probe has to do
        return True


def worker_init(main_pid: int) -> None:
    """Pool initializer: leave Ctrl-C to the main process, and die with it.

    The main process reacts to SIGINT by terminating the pool and removing temporary files.  If
    the main process dies (SIGKILL, OOM) nobody will collect this worker's work: it exits within
    a second, leaving at most a temporary file, never a final name.  (With a forkserver the
    worker's parent is the server, which lives as long as any worker does, so watch the main
    process itself.)
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker inherits the CLI's handler

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if not _alive(main_pid):
                os._exit(1)

    threading.Thread(target=watch, name="shardloader-main-watch", daemon=True).start()


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(path: str) -> Any:
    tok = _TOKENIZERS.get(path)
    if tok is None:
        from tokenizers import Tokenizer

        tok = _TOKENIZERS[path] = Tokenizer.from_file(path)
    return tok


# -- reading and checking samples -----------------------------------------------------------


class _Bad(Exception):
    """A sample cannot be packed; becomes an InputError (fail) or a skip record (skip)."""

    def __init__(self, sample: SampleRef, reason: str, ref: FileRef | None = None) -> None:
        super().__init__(reason)
        self.sample, self.reason, self.ref = sample, reason, ref

    def message(self, spec: WriteSpec) -> str:
        key = self.sample.key
        if self.ref is not None:
            return f"{self.ref.url} (key {key!r}): {self.reason}"
        if self.sample.file:
            return (
                f"{spec.src.join(self.sample.file).url} {self.sample.where} (key {key!r}): "
                f"{self.reason}"
            )
        return f"sample {key!r}: {self.reason}"

    def record(self, number: int) -> dict[str, Any]:
        """The skip report entry: paths relative to SRC, so reports are reproducible."""
        return {
            "shard": number,
            "key": self.sample.key,
            "file": self.ref.rel if self.ref is not None else self.sample.file,
            "where": self.sample.where,
            "reason": self.reason,
        }


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _read(spec: WriteSpec, sample: SampleRef, ref: FileRef) -> bytes:
    try:
        data = spec.input(ref.url).read_bytes()
    except (OSError, StorageError) as err:
        raise _Bad(sample, f"unreadable ({err})", ref) from err
    if len(data) != ref.size:
        raise _Bad(
            sample,
            f"has {len(data)} bytes but had {ref.size} when the pack started; do not change "
            "the input while packing, then re-run",
            ref,
        )
    return data


_DECODE_JSON = msgspec.json.Decoder().decode


def _parse_json(data: bytes) -> Any:
    """Parse a JSON field: msgspec (strict RFC 8259, ~5x faster than ``json``) first; what it
    refuses goes to ``json.loads``, which decides as it always did (it also takes ``NaN`` and
    lone surrogates) and words the error as :func:`codecs.check_field` does.

    The parsers recurse once per nesting level; past the interpreter's recursion limit they
    stop with RecursionError, which becomes a bad sample like any other invalid JSON.
    """
    try:
        return _DECODE_JSON(data)
    except (msgspec.MsgspecError, RecursionError):
        pass
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise InputError(f"invalid UTF-8 at byte {err.start}") from err
    except json.JSONDecodeError as err:
        raise InputError(f"invalid JSON ({err.msg} at char {err.pos})") from err
    except RecursionError as err:
        raise InputError("JSON nested too deeply to parse") from err


def _text_of(
    rule: TextRule, fields: Mapping[str, bytes], value: Any
) -> tuple[str | bytes | None, str]:
    for kind, name in rule.candidates:
        if kind == "field" and name in fields:
            return fields[name], name
        if kind == "json" and "json" in fields:
            text = value.get(name) if isinstance(value, dict) else None
            return (text if isinstance(text, str) else None), f"json key {name!r}"
    return None, " or ".join(n for _, n in rule.candidates)


def _load(spec: WriteSpec, sample: SampleRef) -> tuple[dict[str, bytes], int | None]:
    """Read and check a sample's fields; add derived fields; return (fields, length)."""
    problem = unsafe_key_reason(sample.key)
    if problem is not None:  # readers refuse such keys: never write one
        raise _Bad(sample, _key_reason(problem))
    fields: dict[str, bytes] = {}
    parsed: dict[str, Any] = {}
    for ext, value in sample.fields:
        ref = value if isinstance(value, FileRef) else None
        data: bytes = value if ref is None else _read(spec, sample, ref)  # type: ignore[assignment]
        codec = spec.fields[ext].codec
        try:
            if codec == "json":  # parse once: the text rule may need the value
                parsed[ext] = _parse_json(data)
            else:
                check_field(codec, data, validate_images=spec.validate)
        except InputError as err:
            reason = _ADDRESS.sub("", str(err))  # PIL names object addresses: not reproducible
            raise _Bad(sample, f"field {ext!r}: {reason}", ref) from err
        fields[ext] = data
    return fields, _measure(spec, sample, fields, parsed.get("json"))


def _key_reason(problem: str) -> str:
    return f"sample key {problem}; it could escape a directory when written out"


def _measure(
    spec: WriteSpec, sample: SampleRef | None, fields: dict[str, bytes], value: Any
) -> int | None:
    """The sample's length (text bytes or tokens; adds ``tokens`` when tokenizing).

    ``sample`` names it in errors (None: build it from ``fields``' one line, see
    :func:`_write_run`, which passes it on a failure only)."""
    if spec.text is None:
        return None
    text, what = _text_of(spec.text, fields, value)
    if spec.tokenizer is None:
        if text is None:
            return 0
        if isinstance(text, bytes):
            return len(text)
        try:
            return len(text.encode("utf-8"))
        except UnicodeEncodeError as err:  # a lone surrogate from a "\ud800" escape
            raise _Bad(sample or _NO_SAMPLE, f"{what} is not valid Unicode ({err.reason})") from err
    if text is None:
        raise _Bad(sample or _NO_SAMPLE, f"no text to tokenize ({what} is missing or not a string)")
    try:
        as_str = text if isinstance(text, str) else text.decode("utf-8")
        ids = _tokenizer(spec.tokenizer).encode(as_str).ids
    except UnicodeError as err:
        raise _Bad(sample or _NO_SAMPLE, f"{what} is not valid Unicode ({err})") from err
    dtype = np.dtype(spec.fields["tokens"].dtype or "uint32").newbyteorder("<")
    fields["tokens"] = np.asarray(ids, dtype=dtype).tobytes()
    return len(ids)


_NO_SAMPLE = SampleRef("", ())  # replaced by the caller that knows the sample


def _write_run(
    spec: WriteSpec, run: LineRun, data: bytes, writer: Any, number: int, skips: list[dict]
) -> int:
    """Check and add the lines of ``run`` (``data``: its byte range); return input bytes.

    The per-line path of :func:`_load` for one-field record samples, without building a
    :class:`SampleRef` per line (one is built for a bad line, to name it).  A writer with
    ``add_records`` (tar) takes the good lines in one call."""
    kind, stem, first = run.kind, run.stem, int(run.starts[0])
    codec = spec.fields[kind].codec
    problem = unsafe_key_reason(run.key(0))  # the same for every line: only digits differ
    is_json = codec == "json"
    keys: list[str] = []
    values: list[bytes] = []
    lengths: list[int | None] = []
    bytes_in = 0
    for n, s, k in zip(
        run.numbers.tolist(), run.starts.tolist(), run.lengths.tolist(), strict=True
    ):
        line = data[s - first : s - first + k]
        key = f"{stem}/{n:09d}"
        try:
            if problem is not None:
                raise _Bad(_NO_SAMPLE, _key_reason(problem))
            try:
                value = _parse_json(line) if is_json else None
                if not is_json:
                    check_field(codec, line)
            except InputError as err:
                raise _Bad(_NO_SAMPLE, f"field {kind!r}: {err}") from err
            fields = {kind: line}
            length = _measure(spec, None, fields, value)
        except _Bad as bad:
            bad.sample = SampleRef(key, ((kind, line),), run.rel, f"line {n}")
            _refuse_or_skip(spec, bad, number, skips)
            continue
        bytes_in += k
        if len(fields) > 1:  # a derived field (tokens): this sample goes on its own
            _add_records(writer, keys, kind, values, lengths)
            keys, values, lengths = [], [], []
            writer.add(key, fields, length)
        else:
            keys.append(key)
            values.append(line)
            lengths.append(length)
    _add_records(writer, keys, kind, values, lengths)
    return bytes_in


def _add_records(
    writer: Any, keys: list[str], ext: str, values: list[bytes], lengths: list[int | None]
) -> None:
    if not keys:
        return
    add_records = getattr(writer, "add_records", None)
    if add_records is not None:
        add_records(keys, ext, values, lengths)
        return
    for key, value, length in zip(keys, values, lengths, strict=True):
        writer.add(key, {ext: value}, length)


def _refuse_or_skip(spec: WriteSpec, bad: _Bad, number: int, skips: list[dict]) -> None:
    if spec.on_error == "fail":
        raise InputError(
            f"{bad.message(spec)}; fix or remove it, or pass --on-error skip"
        ) from None
    log.warning("skipping %s", bad.message(spec))
    skips.append(bad.record(number))


# -- one shard ------------------------------------------------------------------------------


def _hash_stored(store: Store) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with store.open_read() as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def _try_keep(spec: WriteSpec, task: ShardTask, digest: str) -> ShardResult | None:
    """A finished shard from an earlier run, if it is intact and was planned the same way."""
    shard, index_store = spec.out.join(task.name), spec.out.join(task.index_name)
    shard_url, index_url = shard.url, index_store.url
    if not (shard.exists() and index_store.exists()):
        return None
    try:
        sidecar = index_store.read_bytes()
        meta = sidecar_meta(sidecar, index_url)
        if meta.get("plan_digest") != digest:
            log.info("%s: planned differently; packing it again", shard_url)
            return None
        sha, size = _hash_stored(shard)
        index = SampleIndex.from_arrow_bytes(sidecar, index_url)
    except ShardloaderError as err:
        log.warning("%s: cannot reuse (%s); packing it again", shard_url, err)
        return None
    if (
        sha != meta.get("sha256")
        or size != meta.get("bytes")
        or len(index) != meta.get("num_samples")
    ):
        log.warning("%s: checksum does not match its sidecar; packing it again", shard_url)
        return None
    return ShardResult(
        task.plan.number,
        task.name,
        task.index_name,
        len(index),
        size,
        int(meta["raw_bytes"]),
        sha,
        hashlib.sha256(sidecar).hexdigest(),
        int(meta.get("bytes_in", 0)),
        tuple(meta.get("skips", ())),
        kept=True,
    )


def write_shard(spec: WriteSpec, task: ShardTask) -> ShardResult:
    """Write one shard to a temporary file (or keep the finished one on resume)."""
    plan = task.plan
    run_bytes = [
        read_run(p, spec.input(p.url)) if isinstance(p, LineRun) else None for p in plan.samples
    ]
    digest = plan_digest(spec.options_digest, plan, run_bytes)
    if spec.resume:
        kept = _try_keep(spec, task, digest)
        if kept is not None:
            return kept
    tmp = temp_name(spec, task.name)
    skips: list[dict[str, Any]] = []
    bytes_in = 0
    try:
        with open(tmp, "wb") as f:
            writer = get_format(spec.fmt, spec.format_module).writer(
                f, spec.compression, spec.fields
            )
            for sample, data in zip(plan.samples, run_bytes, strict=True):
                if data is not None:
                    bytes_in += _write_run(spec, sample, data, writer, plan.number, skips)  # type: ignore[arg-type]
                    continue
                assert isinstance(sample, SampleRef)
                try:
                    fields, length = _load(spec, sample)
                except _Bad as bad:
                    _refuse_or_skip(spec, bad, plan.number, skips)
                    continue
                writer.add(sample.key, fields, length)
                bytes_in += _input_size(sample)
            written: WrittenShard = writer.close()
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove(tmp)
        raise
    meta = {
        "plan_digest": digest,
        "sha256": written.sha256,
        "bytes": written.bytes,
        "raw_bytes": written.raw_bytes,
        "num_samples": written.num_samples,
        "bytes_in": bytes_in,
        "skips": skips,
    }
    sidecar = sidecar_bytes(written.index, meta)
    return ShardResult(
        plan.number,
        task.name,
        task.index_name,
        written.num_samples,
        written.bytes,
        written.raw_bytes,
        written.sha256,
        hashlib.sha256(sidecar).hexdigest(),
        bytes_in,
        tuple(skips),
        temp=tmp,
        sidecar=sidecar,
    )


def _input_size(sample: SampleRef) -> int:
    """Bytes the sample took from the input: its files, or its record (not derived fields)."""
    if sample.file:
        return sum(len(v) for _, v in sample.fields if isinstance(v, bytes))
    return sum(v.size for _, v in sample.fields if isinstance(v, FileRef))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def place_shard(spec: WriteSpec, r: ShardResult) -> ShardResult:
    """Move a written temporary shard to its final name (an atomic rename, or one upload);
    drop it when every sample was skipped.  A kept or already placed shard is left alone."""
    if r.temp is None:
        return r
    if r.num_samples:
        spec.out.join(r.name).put_file(r.temp)
    if os.path.exists(r.temp):  # uploaded (remote OUT), or empty: drop the local copy
        os.remove(r.temp)
    return replace(r, temp=None)


def write_and_place(spec: WriteSpec, task: ShardTask) -> ShardResult:
    """:func:`write_shard` then :func:`place_shard`, for a task on another machine (Ray): its
    temporary file stays there, so the task moves the shard into place itself and hands back
    only the sidecar bytes and the figures.  Temporary files go to ``spec.staging`` when that
    folder exists here (OUT itself, when local and shared), else to a fresh local folder."""
    if os.path.isdir(spec.staging):
        return place_shard(spec, write_shard(spec, task))
    staging = tempfile.mkdtemp(prefix="shardloader-pack-")
    try:
        local = replace(spec, staging=staging)
        return place_shard(local, write_shard(local, task))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
