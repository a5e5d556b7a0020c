"""The ``pack`` orchestrator: raw files → shards + sidecars → manifest last.

discover (sorted, deterministic sample stream) → plan (shard boundaries from exact uncompressed
sizes) → write (temporary shards in N processes) → rename into place + sidecar → manifest.

NOTE [commit protocol]: a shard appears under its final name only when whole (temporary name,
fsync, rename); its sidecar follows; the manifest is written after every shard of the run is in
place, atomically.  A failed or interrupted run removes its temporary files and writes no
manifest; finished shards stay, and ``--resume`` keeps those that still match their checksums
and their plan.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from functools import partial
from typing import Any

from shardloader.errors import ShardError, UsageError
from shardloader.manifest import FORMAT_VERSION, MANIFEST_NAME, FieldInfo, Manifest, ShardInfo
from shardloader.pack.discover import discover
from shardloader.pack.fill import every_sample_skipped, skip_record
from shardloader.pack.layouts.base import Source
from shardloader.pack.listing import below
from shardloader.pack.lock import OutLock, out_lock
from shardloader.pack.notes import after_notes, shard_size_for
from shardloader.pack.options import PACKER_VERSION, PackOptions, PackProgress, PackReport
from shardloader.pack.outdir import SKIP_REPORT, note_skips, open_out, remove_stale, remove_temps
from shardloader.pack.plan import Planner, part_of, shard_names
from shardloader.pack.pool import Executor, make_executor
from shardloader.pack.replace import check_resume, finished_manifest
from shardloader.pack.task import ShardResult, ShardTask, WriteSpec
from shardloader.pack.tokenizer import token_source
from shardloader.pack.write import place_shard, write_and_place, write_shard, writing
from shardloader.read.fields import FieldMap
from shardloader.storage.store import Store
from shardloader.storage.uploads import Uploads

__all__ = ["pack"]


def _options_digest(
    options: PackOptions, source: Source, fields: Mapping[str, FieldInfo], tok: dict | None
) -> str:
    ident = {
        "packer": PACKER_VERSION,
        "format_version": FORMAT_VERSION,
        "format": options.format,
        "compression": options.compression,
        "fields": {k: asdict(v) for k, v in sorted(fields.items())},
        "validate": options.validate,
        "on_error": options.on_error,
        "max_sample_size": options.max_sample_size,  # its skips change the shards
        "text": asdict(source.text) if source.text else None,
        "tokenizer": tok["sha256"] if tok else None,
        "layout": source.layout,
        "classes": list(source.classes),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _check_not_inside(source: Store, target: Store) -> None:
    if source.is_local and not os.path.isdir(source.local_path):
        return  # a single file
    if below(target, source, real=True) is not None:
        raise UsageError(
            f"output {target.url!r} is inside the source {source.url!r}; pick another OUT"
        )


def pack(
    src: str,
    out: str,
    options: PackOptions | None = None,
    *,
    progress: Callable[[PackProgress], None] | None = None,
) -> PackReport:
    """Pack ``src`` (folder, file or fsspec URL) into shards under ``out``; manifest last."""
    options = options or PackOptions()
    start = time.monotonic()
    source_store, out_store = options.store(src), options.store(out)
    _check_not_inside(source_store, out_store)
    # Started first: pack workers import the writer while this process lists and plans.
    executor = make_executor(options)
    try:
        with out_lock(out_store, "pack") as lock:  # NOTE [the OUT lock] in pack/lock.py
            return _pack(source_store, out_store, options, progress, start, executor, lock)
    except BaseException:
        executor.abort()
        raise
    finally:
        executor.shutdown()


def _pack(
    source_store: Store,
    out_store: Store,
    options: PackOptions,
    progress: Callable[[PackProgress], None] | None,
    start: float,
    executor: Executor,
    lock: OutLock,
) -> PackReport:
    existing, old = open_out(out_store, overwrite=options.overwrite, resume=options.resume)
    source = discover(
        source_store,
        options.layout,
        text_field=options.text_field,
        tokenize=options.tokenizer is not None,
        aliases=options.aliases,
        labels=options.labels,
        on_error=options.on_error,
    )
    source, fields, tok_meta = token_source(source_store.url, source, options)  # pack/tokenizer.py

    parted = options.num_parts > 1
    finished = finished_manifest(out_store) if existing else None
    # NOTE [replacing a dataset] in pack/replace.py
    if finished is not None and options.overwrite and executor.remote and not out_store.is_local:
        # Ray tasks place their shards as they finish: the old ones would go first
        raise UsageError(
            f"--overwrite with --executor ray: {out_store.url!r} holds a finished "
            "pack, and Ray tasks would replace its shards one by one before the new "
            "pack is whole; pack into a fresh OUT (then point readers at it), or "
            "remove the old dataset first"
        )
    if existing and options.resume:  # shards are kept or replaced in place: manifest first
        if finished is not None:
            check_resume(out_store, finished, source)
        out_store.join(MANIFEST_NAME).remove()
    local_out = out_store.is_local
    staging = out_store.local_path if local_out else tempfile.mkdtemp(prefix="shardloader-pack-")
    os.makedirs(staging, exist_ok=True)
    spec = WriteSpec(
        src=source_store,
        out=out_store,
        staging=staging,
        run_id=lock.run_id,
        options=options,
        fields=fields,
        options_digest=_options_digest(options, source, fields, tok_meta),
        text=source.text,
        tokenizer=tok_meta["path"] if tok_meta else None,
    )
    run = _Run(spec, progress, start, None if parted else source.total_bytes)
    run.defer = finished is not None and options.overwrite  # placed once every shard is written
    shard_size, notes = shard_size_for(options, source)
    planner = Planner(options.format, shard_size, options.max_samples)

    def on_skip(file: str, where: str, reason: str) -> None:
        if part_of(planner.current, options.num_parts) == options.part:
            run.skips.append(skip_record(planner.current, file, where, reason))

    run.tick()
    local_number = 0
    try:
        items = source.items(on_skip if options.on_error == "skip" else None)
        for plan in planner.shards(items):
            if part_of(plan.number, options.num_parts) != options.part:
                continue
            name, index_name = shard_names(
                plan.number,
                options.format,
                options.compression,
                options.part if parted else None,
                local_number,
            )
            local_number += 1
            run.submit(executor, ShardTask(plan, name, index_name))
        run.drain(all_done=True)
        run.place_deferred(old)
        run.uploads.wait()  # every shard whole in the store before the manifest names it
        shards = [run.infos[n] for n in sorted(run.infos)]
        skips = sorted(run.skips, key=lambda s: s["shard"])
        if skips and not shards:  # nothing packed is a failure, not an empty dataset
            raise every_sample_skipped(skips)
        extra: dict[str, Any] = {}
        note_skips(out_store, skips, extra)
        if source.text is not None:
            extra["length_unit"] = "tokens" if options.tokenizer or options.token_field else "bytes"
        # samples holding each member extension
        extra["field_samples"] = dict(sorted(run.field_samples.items()))
        if tok_meta:  # the tokenizer's sha256, or the --token-field; and the vocabulary size
            extra["tokenizer"] = {k: v for k, v in tok_meta.items() if k != "path" and v}
        if parted:
            extra["part"] = {
                "index": options.part,
                "count": options.num_parts,
                "planned_shards": planner.current,  # the stream is exhausted: all of them
                "shard_numbers": sorted(run.infos),
            }
        logical = FieldMap.build(fields, source.aliases, "--alias")  # members → manifest fields
        manifest = Manifest(
            format=options.format,
            compression=options.compression,
            fields=logical.fields,
            shards=shards,
            classes=source.classes,
            layout=source.layout,
            length_field=source.text.length_field if source.text else None,
            extra=extra,
            aliases=logical.aliases,
        )
        lock.check()  # a run whose lease was taken over writes no manifest
        with writing(f"the manifest {out_store.join(MANIFEST_NAME).url}"):
            out_store.join(MANIFEST_NAME).write_bytes_atomic(manifest.to_json())
    except BaseException:
        executor.abort()  # before removing temporaries: no worker is still writing one
        run.uploads.close()  # before the files they read go
        remove_temps(Store(staging), os.listdir(staging) if os.path.isdir(staging) else [])
        raise
    finally:
        run.uploads.close()
        if not local_out:
            shutil.rmtree(staging, ignore_errors=True)
    if existing:
        remove_stale(out_store, existing, manifest, options.part if parted else None, old)
    return PackReport(
        out=out_store.url,
        manifest=manifest,
        samples=manifest.num_samples,
        shards=len(shards),
        kept_shards=run.kept,
        skipped=len(skips),
        bytes_in=run.bytes_in,
        bytes_out=sum(s.bytes for s in shards),
        raw_bytes=sum(s.raw_bytes for s in shards),
        seconds=time.monotonic() - start,
        skip_report=out_store.join(SKIP_REPORT).url if skips else None,
        ignored=source.ignored,
        notes=(*source.notes, *notes, *after_notes(options, manifest, run.bytes_in)),
    )


class _Run:
    """Bookkeeping of one pack run: in-flight shards, finished shards, totals."""

    def __init__(
        self,
        spec: WriteSpec,
        progress: Callable[[PackProgress], None] | None,
        start: float,
        total_bytes: int | None,
    ) -> None:
        self.spec = spec
        self.progress = progress
        self.start = start
        self.total_bytes = total_bytes
        self.pending: dict[Future[ShardResult], int] = {}
        self.infos: dict[int, ShardInfo] = {}
        self.skips: list[dict[str, Any]] = []
        self.samples = self.bytes_in = self.bytes_out = self.kept = 0
        self.field_samples: Counter[str] = Counter()
        self.uploads = Uploads()
        self.defer = False  # hold finished shards under temporary names until all are written
        self.deferred: list[ShardResult] = []

    def submit(self, executor: Executor, task: ShardTask) -> None:
        # A remote task cannot hand over a temporary file: it moves its shard into place
        # (when deferring, OUT is local and shared: its temporary file is there).
        fn = write_and_place if executor.remote and not self.defer else write_shard
        self.pending[executor.submit(fn, self.spec, task)] = task.plan.number
        if len(self.pending) >= executor.in_flight:  # bounds memory: plans hold samples
            self.drain(all_done=False)

    def drain(self, all_done: bool) -> None:
        while self.pending:
            done, _ = wait(self.pending, return_when=FIRST_COMPLETED)
            for fut in sorted(done, key=self.pending.__getitem__):
                number = self.pending.pop(fut)
                try:
                    result = fut.result()
                except BrokenProcessPool as err:
                    raise ShardError(
                        f"a pack worker died while writing shard {number} ({err}): killed, or "
                        "out of memory? Finished shards are kept; re-run with --resume"
                    ) from err
                self._finish(result)
            if not all_done:
                return

    def place_deferred(self, old: set[str]) -> None:
        """Every new shard is written: move them to their final names, the old manifest
        first out of the way when one of them is a name it lists."""
        if not self.deferred:
            return
        names = {n for r in self.deferred for n in (r.info.path, r.info.index_path)}
        if not names.isdisjoint(old):  # the old manifest lists one of them
            self.spec.out.join(MANIFEST_NAME).remove()
        for r in self.deferred:
            self._put(r)
        self.deferred = []

    def _put(self, r: ShardResult) -> None:
        """Place ``r`` now (a rename, or placed by its task already), else upload it in the
        background: NOTE [background uploads] in storage/uploads.py (overlaps the next shards)."""
        if r.temp is None or self.spec.out.is_local:
            self._place(r)
        else:
            self.uploads.submit(partial(self._place, r))

    def _place(self, r: ShardResult) -> None:
        """The shard to its final name (rename or upload), then its sidecar."""
        place_shard(self.spec, r)
        assert r.sidecar is not None
        sidecar = self.spec.out.join(r.info.index_path)
        with writing(f"sidecar {sidecar.url}"):
            sidecar.write_bytes_atomic(r.sidecar)

    def _finish(self, r: ShardResult) -> None:
        if r.info.num_samples == 0:  # every sample skipped: no shard
            place_shard(self.spec, r)  # drops the temporary file
            self.skips.extend(r.skips)
            return
        if r.kept:
            self.kept += 1
        elif self.defer:  # NOTE [replacing a dataset]: placed when every shard is written
            self.deferred.append(r)
        else:
            self._put(r)
        self.infos[r.number] = r.info
        self.skips.extend(r.skips)
        self.field_samples.update(r.field_samples)
        self.samples += r.info.num_samples
        self.bytes_in += r.bytes_in
        self.bytes_out += r.info.bytes
        self.tick()

    def tick(self) -> None:
        """Report the running totals, if anyone listens."""
        if self.progress is not None:
            self.progress(
                PackProgress(
                    self.samples,
                    len(self.infos),
                    self.bytes_in,
                    self.bytes_out,
                    self.total_bytes,
                    time.monotonic() - self.start,
                )
            )
