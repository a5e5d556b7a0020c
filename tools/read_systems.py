"""The systems ``tools/bench_read.py`` compares: how each one writes the corpus and reads it back.

Every system gets the same samples (the JPEGs and JSONL lines ``tools/make_corpus.py`` wrote)
and is read the way its documentation says: raw (undecoded) samples, batches of 32, shuffled.
shardloader packs with its own CLI (``shardloader pack``), exactly what a user runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = [
    "PEERS",
    "SHARDLOADER",
    "count_batch",
    "corpus_samples",
    "import_system",
    "make_loader",
    "payload_field",
    "write_system",
]

# shardloader variants: (shard format, collate: "raw" = RawBatch, "dicts" = a list of dicts)
SHARDLOADER = {
    "shardloader": ("tar", "raw"),
    "shardloader-dicts": ("tar", "dicts"),
    "shardloader-arrow": ("arrow", "raw"),
    "shardloader-arrow-dicts": ("arrow", "dicts"),
    "shardloader-noverify": ("tar", "raw"),
    "shardloader-baseline": ("tar", "dicts"),  # another checkout (bench_read.py --baseline)
}
PEERS = ("litdata", "mosaicml", "hf-datasets", "webdataset", "files")
FIELD = {"images": "jpg", "docs": "json"}  # the payload field of the peers' samples


def payload_field(system: str, corpus: str) -> str:
    """The field holding each sample's payload: what ``shardloader pack`` names it (``image``
    for class folders, ``json`` for JSONL lines), what we named it for the peers, ``data`` for
    plain files."""
    if system in SHARDLOADER:
        return "image" if corpus == "images" else "json"
    return "data" if system == "files" else FIELD[corpus]


# ------------------------------------------------------------------------------- the corpus


def corpus_samples(corpus_dir: str, corpus: str) -> Iterator[tuple[str, bytes, int]]:
    """(key, payload bytes, label) of every sample, in a fixed order: each JPEG with its class
    number, each JSONL line (without its newline) with label 0."""
    if corpus == "images":
        root = os.path.join(corpus_dir, "images")
        for label, cls in enumerate(sorted(os.listdir(root))):
            for name in sorted(os.listdir(os.path.join(root, cls))):
                with open(os.path.join(root, cls, name), "rb") as f:
                    yield f"{cls}/{name.split('.')[0]}", f.read(), label
        return
    root = os.path.join(corpus_dir, "docs")
    for part in sorted(os.listdir(root)):
        with open(os.path.join(root, part), "rb") as f:
            for i, line in enumerate(f):
                line = line.rstrip(b"\n")
                if line:
                    yield f"{part.split('.')[0]}/{i:09d}", line, 0


# ------------------------------------------------------------------------------- writers


def write_system(system: str, corpus_dir: str, corpus: str, out: str) -> str:
    """Write ``corpus`` for ``system`` into ``out``; return what its reader opens."""
    shutil.rmtree(out, ignore_errors=True)
    if system in SHARDLOADER:
        fmt = SHARDLOADER[system][0]
        cmd = [sys.executable, "-m", "shardloader", "pack", os.path.join(corpus_dir, corpus), out]
        subprocess.run([*cmd, "--format", fmt, "--workers", "2"], check=True)
        return out
    os.makedirs(out)
    samples = corpus_samples(corpus_dir, corpus)
    ext = FIELD[corpus]
    if system == "webdataset":
        return _write_webdataset(samples, out, ext)
    if system == "litdata":
        _write_litdata(list(samples), out, ext)
    elif system == "mosaicml":
        _write_mosaic(samples, out, ext)
    elif system == "hf-datasets":
        _write_hf(list(samples), out, ext)
    elif system == "files":
        _write_files(samples, out, ext)
    else:
        raise SystemExit(f"unknown system {system!r}")
    return out


def _write_webdataset(samples: Iterable[tuple[str, bytes, int]], out: str, ext: str) -> str:
    import webdataset as wds

    pattern = os.path.join(out, "wds-%05d.tar")
    with wds.ShardWriter(pattern, maxsize=128 << 20, maxcount=10**9, verbose=0) as sink:
        for key, data, label in samples:
            sink.write({"__key__": key.replace("/", "_"), ext: data, "cls": label})
    return out


def _litdata_item(item: Any) -> Any:
    return item


def _write_litdata(samples: list[tuple[str, bytes, int]], out: str, ext: str) -> None:
    from litdata import optimize

    optimize(
        fn=_litdata_item,
        inputs=[{"key": k, ext: d, "cls": c} for k, d, c in samples],
        output_dir=out,
        chunk_bytes="64MB",
        num_workers=1,
        mode="overwrite",
    )


def _write_mosaic(samples: Iterable[tuple[str, bytes, int]], out: str, ext: str) -> None:
    from streaming.base import MDSWriter

    columns = {"key": "str", ext: "bytes", "cls": "int"}
    with MDSWriter(out=out, columns=columns, compression="zstd", size_limit="64mb") as w:
        for key, data, label in samples:
            w.write({"key": key, ext: data, "cls": label})


def _write_hf(samples: list[tuple[str, bytes, int]], out: str, ext: str) -> None:
    import datasets

    columns = {"key": [k for k, _, _ in samples], ext: [d for _, d, _ in samples]}
    columns["cls"] = [c for _, _, c in samples]
    datasets.Dataset.from_dict(columns).save_to_disk(out)


def _write_files(samples: Iterable[tuple[str, bytes, int]], out: str, ext: str) -> None:
    """One file per sample in class (or part) folders: the ImageFolder baseline."""
    for key, data, _ in samples:
        path = os.path.join(out, f"{key}.{ext}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


# ------------------------------------------------------------------------------- readers


def import_system(system: str) -> None:
    """Import what ``system`` reads with (before the clock starts: a process imports once)."""
    import torch.utils.data  # noqa: F401

    if system in SHARDLOADER:
        import shardloader
        import shardloader.dataset  # noqa: F401  (its lazy attribute would import it later)
        import shardloader.deliver.loader  # noqa: F401
    elif system == "litdata":
        import litdata  # noqa: F401
    elif system == "mosaicml":
        import streaming.base  # noqa: F401
    elif system == "hf-datasets":
        import datasets  # noqa: F401
    elif system == "webdataset":
        import webdataset  # noqa: F401


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


class _Files:
    """A map-style dataset of one file per sample (what torchvision's ImageFolder reads)."""

    def __init__(self, root: str) -> None:
        self.paths = sorted(
            os.path.join(d, f) for d, _, files in os.walk(root) for f in files if "." in f
        )

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        with open(self.paths[i], "rb") as f:
            return {"data": f.read(), "cls": i}


class _HF:
    def __init__(self, path: str) -> None:
        import datasets

        self.ds = datasets.load_from_disk(path)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.ds[i]  # type: ignore[no-any-return]


def make_loader(system: str, where: str, workers: int, batch: int) -> Iterable[Any]:
    """The loader a user of ``system`` writes for shuffled raw samples in batches."""
    from torch.utils.data import DataLoader

    kw: dict[str, Any] = {"num_workers": workers}
    if workers:
        # one start method for everyone (an imported peer may switch the default to spawn)
        kw.update(prefetch_factor=4, multiprocessing_context="fork", persistent_workers=False)
    if system in SHARDLOADER:
        import shardloader as sl

        collate: Callable[..., Any] = _as_list
        if SHARDLOADER[system][1] == "raw":
            collate = sl.RawCollate()
        read = None
        if system == "shardloader-noverify":
            read = sl.ReadOptions(verify_samples=False)
        ds = sl.ShardedDataset(
            where, batch_size=batch, shuffle=True, decoder=None, collate_fn=collate, read=read
        )
        return sl.make_loader(ds, **kw)  # type: ignore[no-any-return]
    if system == "webdataset":
        import webdataset as wds

        urls = sorted(os.path.join(where, f) for f in os.listdir(where) if f.endswith(".tar"))
        pipe = wds.WebDataset(
            urls,
            shardshuffle=len(urls),
            nodesplitter=wds.split_by_node,
            workersplitter=wds.split_by_worker,
            empty_check=False,
            seed=0,
        )
        return DataLoader(pipe.shuffle(1000).batched(batch, collation_fn=_as_list), None, **kw)
    if system == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(where, shuffle=True)
        return StreamingDataLoader(ds, batch_size=batch, collate_fn=_as_list, **kw)  # type: ignore[no-any-return]
    if system == "mosaicml":
        from streaming.base import StreamingDataset

        ds = StreamingDataset(local=where, shuffle=True, batch_size=batch)
        return DataLoader(ds, batch_size=batch, collate_fn=_as_list, **kw)
    if system == "hf-datasets":
        return DataLoader(_HF(where), batch_size=batch, shuffle=True, collate_fn=_as_list, **kw)
    if system == "files":
        return DataLoader(_Files(where), batch_size=batch, shuffle=True, collate_fn=_as_list, **kw)
    raise SystemExit(f"unknown system {system!r}")


def count_batch(batch: Any, field: str) -> tuple[int, int]:
    """(samples, payload bytes) of a batch, touching every sample's payload as a user would:
    a RawBatch's column yields each sample's bytes, a list holds one dict per sample."""
    if isinstance(batch, dict):  # shardloader's RawBatch: one column per field
        column = batch[field]
        return len(column), sum(len(b) for b in column)
    return len(batch), sum(len(sample[field]) for sample in batch)
