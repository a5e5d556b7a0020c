"""Write one planned shard: a temporary file, filled, fsynced, its sidecar; or keep it on resume.

Runs in a worker process (or inline with ``--workers 1``), given the frozen task of
pack/task.py; pack/fill.py reads and checks its samples into the format's writer.  The worker
writes ``.<name>.tmp-<run id>`` and fsyncs it; the main process renames it to its final name
(or uploads it), writes the sidecar, and the manifest last.

A resumed run keeps the finished shards that still match their plan and checksum (NOTE [resume]
in pack/resume.py).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import replace
from typing import Any

from shardloader.errors import ShardloaderError, StorageError
from shardloader.format.base import WrittenShard
from shardloader.format.registry import get_format
from shardloader.manifest import SampleIndex, ShardInfo
from shardloader.pack.fill import fill_shard
from shardloader.pack.layouts.lines import read_run
from shardloader.pack.lock import alive
from shardloader.pack.refs import LineRun
from shardloader.pack.resume import plan_digest, sidecar_bytes, sidecar_meta
from shardloader.pack.task import ShardResult, ShardTask, WriteSpec
from shardloader.storage.streams import HashingReader
from shardloader.storage.uploads import put_file_recorded

__all__ = ["writing", "write_shard", "place_shard", "write_and_place", "worker_init"]

log = logging.getLogger(__name__)

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# figures a kept shard's result takes from its sidecar unchecked (sha256, bytes, num_samples are
# checked against the file): a sidecar without them (written by another build) is packed again
_FIGURES = {"raw_bytes", "bytes_in", "skips", "field_samples"}


@contextmanager
def writing(what: str) -> Iterator[None]:
    """Turn an OSError while writing ``what`` (a path, named as the user gave OUT) into one
    :class:`StorageError` naming it, so a full disk is one line and exit 1, not a traceback.
    Whatever is whole is kept: the finished shards and their sidecars, which ``--resume``
    reuses; the caller removes its temporary file."""
    try:
        yield
    except ShardloaderError:
        raise
    except OSError as err:
        reason = err.strerror or str(err)
        if err.errno in _FULL:
            hint = "the disk (or your quota) is full: free space, or pack to another OUT"
        else:
            hint = "check the folder's permissions and file system"
        raise StorageError(
            f"cannot write {what}: {reason}; {hint}, then re-run with --resume (the shards "
            "finished so far are kept)"
        ) from err


# -- worker process -------------------------------------------------------------------------


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
            if not alive(main_pid):
                os._exit(1)

    threading.Thread(target=watch, name="shardloader-main-watch", daemon=True).start()


# -- one shard ------------------------------------------------------------------------------


def _try_keep(spec: WriteSpec, task: ShardTask, digest: str) -> ShardResult | None:
    """A finished shard from an earlier run, if it is intact and was planned the same way."""
    shard, index_store = spec.out.join(task.name), spec.out.join(task.index_name)
    shard_url, index_url = shard.url, index_store.url
    if not (shard.exists() and index_store.exists()):
        return None
    try:
        sidecar = index_store.read_bytes()
        meta = sidecar_meta(sidecar, index_url)
        if meta.get("plan_digest") != digest or not _FIGURES <= meta.keys():
            log.info("%s: planned differently (or by another build); packing it again", shard_url)
            return None
        with shard.open_read() as f:
            stored = HashingReader(f)
            stored.drain()
        sha, size = stored.hexdigest(), stored.pos
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
    return _result(task, meta, sidecar, kept=True)


def _result(task: ShardTask, meta: Mapping[str, Any], data: bytes, **more: Any) -> ShardResult:
    """A shard's figures, from the resume record its sidecar ``data`` holds (NOTE [resume])."""
    info = ShardInfo(
        task.name,
        int(meta["num_samples"]),
        int(meta["bytes"]),
        int(meta["raw_bytes"]),
        str(meta["sha256"]),
        task.index_name,
        hashlib.sha256(data).hexdigest(),
    )
    return ShardResult(
        task.plan.number,
        info,
        int(meta["bytes_in"]),
        tuple(meta["skips"]),
        meta["field_samples"],
        **more,
    )


def write_shard(spec: WriteSpec, task: ShardTask) -> ShardResult:
    """Write one shard to a temporary file (or keep the finished one on resume)."""
    plan = task.plan
    run_bytes = [
        read_run(p, spec.input(p.url)) if isinstance(p, LineRun) else None for p in plan.samples
    ]
    digest = plan_digest(spec.options_digest, plan, run_bytes)
    if spec.options.resume:
        kept = _try_keep(spec, task, digest)
        if kept is not None:
            return kept
    tmp = os.path.join(spec.staging, f".{task.name}.tmp-{spec.run_id}")  # until it is placed
    skips: list[dict[str, Any]] = []
    try:
        with writing(f"shard {spec.out.join(task.name).url} (writing {tmp})"), open(tmp, "wb") as f:
            writer = get_format(spec.options.format, spec.format_module).writer(
                f, spec.options.compression, spec.fields
            )
            # samples holding each field (absent is not 0 bytes): ``inspect`` and the pack
            # summary say "txt in 432 of 480 samples" from these counts
            counts: dict[str, int] = {}

            def add(key: str, fields: Mapping[str, bytes], length: int | None) -> None:
                writer.add(key, fields, length)
                for ext in fields:  # a loop: Counter.update costs more a sample
                    counts[ext] = counts.get(ext, 0) + 1

            bytes_in = fill_shard(spec, plan, run_bytes, add, skips)
            written: WrittenShard = writer.close()
            f.flush()
            if spec.out.is_local:  # a remote OUT's temporary is only read back to upload it:
                os.fsync(f.fileno())  # durability is the store's, and a crash loses it anyway
    except BaseException:
        with suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    meta = {
        "plan_digest": digest,
        "sha256": written.sha256,
        "bytes": written.bytes,
        "raw_bytes": written.raw_bytes,
        "num_samples": written.num_samples,
        "bytes_in": bytes_in,
        "skips": skips,
        "field_samples": dict(sorted(counts.items())),
    }
    sidecar = sidecar_bytes(written.index, meta)
    return _result(task, meta, sidecar, temp=tmp, sidecar=sidecar)


def place_shard(spec: WriteSpec, r: ShardResult) -> ShardResult:
    """Move a written temporary shard to its final name (an atomic rename, or one upload);
    drop it when every sample was skipped.  A kept or already placed shard is left alone."""
    if r.temp is None:
        return r
    if r.info.num_samples:
        with writing(f"shard {spec.out.join(r.info.path).url}"):
            # storage/uploads.py; S3 checks the upload against the manifest's sha256
            put_file_recorded(spec.out, r.info.path, r.temp, spec.run_id, r.info.sha256)
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
    with tempfile.TemporaryDirectory(prefix="shardloader-pack-", ignore_cleanup_errors=True) as tmp:
        local = replace(spec, staging=tmp)
        return place_shard(local, write_shard(local, task))
