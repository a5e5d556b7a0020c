"""Fuzz tar, token, Arrow and Parquet shards: damage a shard, then verify, inspect and read it.

Each case copies a small packed dataset (Parquet files: adopted by ``shardloader index``),
mutates one shard (random bytes, a cut, both, damage aimed at its structure; sometimes its
``.idx.arrow`` sidecar too) and, unless ``--keep-checksums``, writes the damaged files'
sha256 and sizes into index.json, as a buggy or hostile producer would, so the manifest's check
passes and the shard's own structure and per-sample checksums must catch the damage.

The checks run in a child process (a crash ends the child, not the fuzzer): ``shardloader
verify``, ``shardloader inspect`` (the CLI, in process) and a read of every sample with
:class:`shardloader.ShardedDataset`.  A case is bad when a check crashes or ends in a traceback,
when an error does not name the damaged shard, or when verify or the read succeed with samples
that differ from the undamaged dataset's (a change only to bytes no reader looks at, such as tar
padding, passes with identical samples: that is fine).

    PYTHONPATH=$PWD python tools/fuzz_shards.py --runs 200 --work /tmp/fz
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

# every compression each format can have (an Arrow shard compresses its buffers inside)
COMBOS = [(fmt, comp) for fmt in ("tar", "tokens") for comp in ("none", "zstd", "gzip")] + [
    ("arrow", "none"),
    ("arrow", "zstd"),
    ("parquet", "none"),  # Parquet files adopted by `shardloader index`, not packed
    ("hf-parquet", "none"),  # the same, written by Hugging Face `datasets` (its features)
]


def make_source(path: str, n: int = 40, seed: int = 0) -> str:
    """A JSONL of ``n`` records with text and pre-tokenized ``input_ids``."""
    rng = random.Random(seed)
    os.makedirs(path, exist_ok=True)
    src = os.path.join(path, "docs.jsonl")
    with open(src, "w") as f:
        for _ in range(n):
            text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 300)))
            ids = [rng.randint(0, 60000) for _ in range(rng.randint(1, 200))]
            f.write(json.dumps({"text": text, "input_ids": ids}) + "\n")
    return src


def pack_template(src: str, out: str, fmt: str, comp: str) -> None:
    from shardloader.pack import PackOptions, pack

    if fmt == "parquet":
        index_template(src, out)
        return
    if fmt == "hf-parquet":
        hf_template(src, out)
        return
    extra: dict[str, Any] = {"token_field": "input_ids"} if fmt == "tokens" else {}
    pack(src, out, PackOptions(format=fmt, compression=comp, max_samples=16, **extra))


def index_template(src: str, out: str) -> None:
    """``src``'s records as three Parquet files in ``out`` (plain; dictionary and snappy; zstd
    with statistics; row groups of 5 rows), adopted there by ``shardloader index``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardloader.pack.index_existing import index_shards

    with open(src) as f:
        records = [json.loads(line) for line in f]
    os.makedirs(out, exist_ok=True)
    settings: list[dict[str, Any]] = [
        {"compression": "none", "use_dictionary": False, "write_statistics": False},
        {"compression": "snappy", "use_dictionary": True},
        {"compression": "zstd", "use_dictionary": False, "data_page_version": "2.0"},
    ]
    per = -(-len(records) // len(settings))
    for k, options in enumerate(settings):
        rows = records[k * per : (k + 1) * per]
        table = pa.table(
            {
                "text": [r["text"] for r in rows],
                "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),
                "blob": pa.array([r["text"].encode()[:40] for r in rows], pa.binary()),
                "n": pa.array([len(r["input_ids"]) for r in rows], pa.int64()),
            }
        )
        pq.write_table(table, os.path.join(out, f"part{k}.parquet"), row_group_size=5, **options)
    index_shards([out], out)


def _picture(i: int) -> bytes:
    """A small PNG or JPEG (every other one), its size and colour varying with ``i``."""
    from PIL import Image

    buf = io.BytesIO()
    pixels = bytes((i * 37 + k) % 256 for k in range(3 * (4 + i % 5) * 6))
    Image.frombytes("RGB", (6, 4 + i % 5), pixels).save(buf, "PNG" if i % 2 else "JPEG")
    return buf.getvalue()


def hf_template(src: str, out: str) -> None:
    """``src``'s records as three Parquet files written by Hugging Face ``datasets``
    (``Dataset.from_dict(...).cast(features).to_parquet``, row groups of 5 rows): an ``Image``
    struct of PNG or JPEG bytes, a ``ClassLabel``, a ``Sequence`` of int32 and a string, the
    features in the schema's ``huggingface`` metadata; adopted by ``shardloader index``."""
    import datasets

    from shardloader.pack.index_existing import index_shards

    with open(src) as f:
        records = [json.loads(line) for line in f]
    os.makedirs(out, exist_ok=True)
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=["cat", "dog", "bird"]),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "text": datasets.Value("string"),
        }
    )
    per = -(-len(records) // 3)
    datasets.disable_progress_bars()
    for k in range(3):
        rows = list(range(k * per, min((k + 1) * per, len(records))))
        table = {
            "image": [{"bytes": _picture(i), "path": None} for i in rows],
            "label": [i % 3 for i in rows],
            "input_ids": [records[i]["input_ids"] for i in rows],
            "text": [records[i]["text"] for i in rows],
        }
        ds = datasets.Dataset.from_dict(table).cast(features)
        ds.to_parquet(os.path.join(out, f"train-{k:05d}-of-00003.parquet"), batch_size=5)
    index_shards([out], out)


def read_samples(out: str, cache: str) -> list[list[Any]]:
    """Every sample of ``out`` as [key, sorted (field, bytes)] (JSON-friendly: hex)."""
    import shardloader as sl

    opts = sl.ReadOptions(cache=sl.CacheOptions(dir=cache))
    samples = []
    for s in sl.ShardedDataset(out, decoder=None, read=opts):
        fields = sorted([k, v.hex()] for k, v in s.items() if not k.startswith("__"))
        samples.append([s["__key__"], fields])
    return samples


def read_blocks(out: str, cache: str) -> list[str] | None:
    """A token dataset's rows as ``TokenBlocks`` cuts them (each batch's ids, hex); None for
    another format."""
    import shardloader as sl
    from shardloader.batching import TokenBlocks

    manifest, _ = sl.read_manifest(out)
    if manifest.format != "tokens":
        return None
    vocab = manifest.extra["tokenizer"]["vocab_size"]
    planner = TokenBlocks(seq_len=64, rows_per_batch=4, pad_id=vocab)
    opts = sl.ReadOptions(cache=sl.CacheOptions(dir=cache))
    ds = sl.ShardedDataset(out, planner=planner, read=opts)
    return [batch["input_ids"].numpy().tobytes().hex() for batch in ds]


def read_remote(out: str, cache: str) -> list[list[Any]] | None:
    """A zstd tar dataset's samples read from an object store (fsspec's memory://, this
    process's), so each shard's sample index comes inside it (format/embedded.py); None for
    another format."""
    import uuid

    import fsspec

    import shardloader as sl

    manifest, _ = sl.read_manifest(out)
    if (manifest.format, manifest.compression) != ("tar", "zstd"):
        return None
    fs, root = fsspec.filesystem("memory"), f"/fuzz-{uuid.uuid4().hex}"
    for name in os.listdir(out):
        with open(os.path.join(out, name), "rb") as f:
            fs.pipe_file(f"{root}/{name}", f.read())
    try:
        return read_samples(f"memory://{root}", cache)
    finally:
        fs.rm(root, recursive=True)


# "inner": aimed at structure; "frame" (a zstd tar's): at its embedded sample index
HOWS = ("bytes", "cut", "both", "inner", "inner", "insert")


def mutate(
    case: str,
    rng: random.Random,
    fix: bool,
    sidecars: float = 0.25,
    hows: Sequence[str] = HOWS,
    shard: bool = True,
) -> dict[str, Any]:
    """Damage one shard of the dataset copied to ``case`` (unless not ``shard``) and its
    sidecar, a ``sidecars`` share of the time, each in one of ``hows``; return what was done."""
    with open(os.path.join(case, "index.json")) as f:
        manifest = json.load(f)
    i = rng.randrange(len(manifest["shards"]))
    entry = manifest["shards"][i]
    targets = [entry["path"]] if shard else []
    if rng.random() < sidecars:
        targets.append(entry["index_path"])
    done = {"shard": entry["path"], "edits": []}
    for name in targets:
        path = os.path.join(case, name)
        with open(path, "rb") as f:
            data = bytearray(f.read())
        original = bytes(data)
        how = rng.choice(hows)
        if how in ("inner", "frame", "meta") and name != entry["path"]:
            how = "bytes"  # a sidecar is damaged as it is stored
        if how == "inner" and b"huggingface" in data and rng.random() < 0.5:
            how = "meta"  # a `datasets` Parquet file: its features, half the time
        frame = min(_frame_ends(bytes(data)))  # the embedded index's start, or the end
        if how == "frame" and frame == len(data):
            how = "bytes"  # no embedded index
        if how == "inner":
            data = _mutate_inner(name, bytes(data), rng)
        elif how == "frame":
            _mutate_frame(data, frame, rng)
        elif how == "meta":
            data = _mutate_hf_meta(bytes(data), rng)
        elif how == "insert":
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.choice([1, 7, 512, 4096]))
        if how in ("bytes", "both") and data:
            for _ in range(rng.choice([1, 1, 2, 4, 16])):
                at = rng.randrange(len(data))
                data[at] = rng.randrange(256)
        if how in ("cut", "both") and data:
            cut = rng.randrange(len(data))
            # a compressed stream cut short must fail where it is read, even where what is
            # lost is no sample's (a zstd tar's index frame): unless it is cut between frames
            if name == entry["path"] and not name.endswith((".tar", ".tok")):
                done["cut_stream"] = cut not in _frame_ends(bytes(data))
            del data[cut:]
        with open(path, "wb") as f:
            f.write(data)
        done["changed"] = done.get("changed", False) or data != original
        done["edits"].append([name, how, len(data)])
        if fix:
            digest = hashlib.sha256(bytes(data)).hexdigest()
            if name == entry["path"]:
                entry["sha256"], entry["bytes"] = digest, len(data)
                if name.endswith(".parquet"):  # its raw bytes are its stored bytes
                    entry["raw_bytes"] = len(data)
            else:
                entry["index_sha256"] = digest
    if fix:
        for total in ("bytes", "raw_bytes"):
            manifest[total] = sum(s[total] for s in manifest["shards"])
        with open(os.path.join(case, "index.json"), "w") as f:
            json.dump(manifest, f)
    return done


def _compression(name: str) -> str:
    return "zstd" if name.endswith(".zst") else "gzip" if name.endswith(".gz") else "none"


def _places(raw: bytes, name: str) -> list[int]:
    """Offsets in an uncompressed shard where damage tells most: tar headers' name, size,
    checksum and type fields; a token shard's header and records."""
    if name.endswith(".arrow"):
        return _arrow_places(raw)
    if name.endswith(".parquet"):
        return _parquet_places(raw)
    if ".tar" in name:
        heads = [b for b in range(0, len(raw) - 511, 512) if raw[b + 257 : b + 262] == b"ustar"]
        fields = [*range(0, 100), *range(124, 136), *range(148, 157), 345]
        return [h + f for h in heads for f in fields]
    from shardloader.format.tokens.layout import HEADER_BYTES, Header

    head = Header(raw[:HEADER_BYTES])
    return [*range(0, 128), *range(head.records_at, len(raw))]


def _arrow_places(raw: bytes) -> list[int]:
    """An uncompressed Arrow file's offset buffers and everything that is not a value buffer
    (footer, message metadata, validity): what pyarrow trusts.  A file whose buffers are
    compressed (not read in place) gets none: random places."""
    import pyarrow as pa

    whole = pa.py_buffer(raw)
    reader = pa.ipc.open_file(whole)
    places: list[int] = []
    values = bytearray(len(raw))  # 1 where a value buffer lies
    for b in range(reader.num_record_batches):
        for column in reader.get_batch(b).columns:
            _, offsets, data = column.buffers()[:3]
            for buf, into_values in ((offsets, False), (data, True)):
                at = None if buf is None else buf.address - whole.address
                if at is None or not 0 <= at <= len(raw) - buf.size:
                    return []
                if into_values:
                    values[at : at + buf.size] = bytes([1]) * buf.size
                else:
                    places += range(at, at + buf.size)
    return places + [i for i, v in enumerate(values) if not v]


def _parquet_places(raw: bytes) -> list[int]:
    """A Parquet file's magic, page headers (the first bytes of each column chunk's pages) and
    footer (its Thrift metadata, length and magic): what the reader parses before values."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    footer = int.from_bytes(raw[-8:-4], "little") + 8
    places = [*range(4), *range(max(0, len(raw) - footer), len(raw))]
    md = pq.ParquetFile(pa.py_buffer(raw)).metadata
    for g in range(md.num_row_groups):
        for c in range(md.num_columns):
            col = md.row_group(g).column(c)
            for at in (col.dictionary_page_offset, col.data_page_offset):
                if at is not None:
                    places += range(at, min(at + 40, len(raw)))
    return places


def _mutate_inner(name: str, data: bytes, rng: random.Random) -> bytearray:
    """Damage the uncompressed shard where it has structure and compress it again (the
    compressed stream is whole, its content hostile); a zstd shard keeps its index frame."""
    import gzip

    import zstandard

    comp = _compression(name)
    frame = b""
    if comp == "zstd":
        ends = sorted(_frame_ends(data))
        if len(ends) > 1:
            data, frame = data[: ends[0]], data[ends[0] :]
        raw = bytearray(zstandard.ZstdDecompressor().stream_reader(data).read())
    else:
        raw = bytearray(gzip.decompress(data) if comp == "gzip" else data)
    places = _places(bytes(raw), name)
    for _ in range(rng.choice([1, 1, 2, 3])):
        if not raw:
            break
        at = rng.choice(places) if places and rng.random() < 0.8 else rng.randrange(len(raw))
        at = min(at, len(raw) - 1)  # an earlier cut shortened it
        kind = rng.random()
        if kind < 0.6:
            raw[at] = rng.choice([0, 0x30 + rng.randrange(10), 0xFF, rng.randrange(256)])
        elif kind < 0.8:
            del raw[at : at + rng.choice([1, 512, 4096])]
        else:
            raw[at:at] = rng.randbytes(rng.choice([1, 512]))
    if comp == "zstd":
        return bytearray(zstandard.ZstdCompressor(level=3).compress(bytes(raw)) + frame)
    return bytearray(gzip.compress(bytes(raw), mtime=0) if comp == "gzip" else raw)


def _mutate_hf_meta(data: bytes, rng: random.Random) -> bytearray:
    """Damage a ``datasets`` Parquet file's ``huggingface`` features JSON where pyarrow reads
    it (inside the footer's base64 ``ARROW:schema``), or its plain copy in the footer's
    key-value metadata, or the base64 text itself, keeping every length (the Thrift footer
    stays whole): a byte, a letter of a name, or a ``[...]``/``{...}`` replaced by another JSON
    value of the same length (``1``, ``null``, ``"x"``, ``{}``, ``[[]]``, padded)."""
    import base64
    import re

    out = bytearray(data)
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    found = re.search(rb"ARROW:schema.{1,6}?([A-Za-z0-9+/]{64,}={0,2})", data[footer:], re.S)
    where = rng.random()
    if found is not None and where < 0.15:  # the base64 text: a flatbuffer pyarrow decodes
        at = footer + found.start(1) + rng.randrange(len(found.group(1)))
        out[at] = rng.choice(b"AZaz09+/=\x00")
        return out
    if found is not None and where < 0.8:
        start, end = footer + found.start(1), footer + found.end(1)
        schema = bytearray(base64.b64decode(data[start:end]))
        _mutate_json(schema, rng)
        out[start:end] = base64.b64encode(bytes(schema))
        return out
    _mutate_json(out, rng)
    return out


def _mutate_json(data: bytearray, rng: random.Random) -> None:
    """Damage the ``{"info": ...}`` JSON inside ``data`` in place, its length kept."""
    start = data.find(b'{"info"')
    if start < 0:
        data[rng.randrange(len(data))] ^= 0xFF
        return
    end = start + json.JSONDecoder().raw_decode(data[start:].decode("utf-8", "replace"))[1]
    kind = rng.random()
    if kind < 0.3:  # any byte
        at = rng.randrange(start, end)
        data[at] = rng.choice(b'"[]{},:0 x\xff\x00')
    elif kind < 0.5:  # a letter of a name or a type ("Image", "ClassLabel", "cat")
        letters = [i for i in range(start, end) if chr(data[i]).isalpha()]
        data[rng.choice(letters)] ^= 0x01
    else:  # a list or object replaced by a value of another shape, or of the same
        opens = [i for i in range(start + 1, end) if data[i] in b"[{"]
        at = rng.choice(opens)
        depth, close = 0, at
        for close in range(at, end):
            depth += (data[close] in b"[{") - (data[close] in b"]}")
            if depth == 0:
                break
        size = close + 1 - at
        value = rng.choice([b"1", b"null", b'"x"', b"{}", b"[]", b"[[]]", b"[1]", b'{"a": 1}'])
        if len(value) <= size:
            data[at : close + 1] = value + b" " * (size - len(value))


def _mutate_frame(data: bytearray, at: int, rng: random.Random) -> None:
    """Damage a zstd shard's embedded sample index frame, which starts at ``at``: its magic
    or lengths (8 bytes each end), or its Arrow index."""
    for _ in range(rng.choice([1, 1, 2, 4])):
        where = rng.random()
        if where < 0.3:
            i = at + rng.randrange(8)
        elif where < 0.5:
            i = len(data) - 1 - rng.randrange(8)
        else:
            i = rng.randrange(at + 8, len(data) - 8)
        data[i] = rng.choice([0, 0xFF, data[i] ^ (1 << rng.randrange(8)), rng.randrange(256)])


def _frame_ends(data: bytes) -> set[int]:
    """Where a zstd shard may end whole: its end, and the start of its index frame (a
    skippable frame at the end, format/embedded.py)."""
    from shardloader.format.embedded import MAGIC

    at = data.rfind(MAGIC.to_bytes(4, "little"))
    whole = at >= 0 and at + 8 + int.from_bytes(data[at + 4 : at + 8], "little") == len(data)
    return {len(data), at} if whole else {len(data)}


def _cli(args: Sequence[str]) -> tuple[int, str]:
    """Run the shardloader CLI in process: (exit code, stderr); a traceback raises."""
    from shardloader.cli import main

    err = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(list(args), standalone_mode=False)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return code, err.getvalue()


def check(case: str, cache: str) -> dict[str, Any]:
    """verify, inspect and read ``case``: each an outcome ``ok``/``error``/``traceback``."""
    from shardloader.errors import ShardloaderError

    result: dict[str, Any] = {}
    for name in ("verify", "inspect"):
        try:
            code, err = _cli([name, case])
            result[name] = ["ok" if code == 0 else "error", err.strip()[:600]]
        except Exception:
            result[name] = ["traceback", traceback.format_exc()[-1500:]]
    for name, read in (("read", read_samples), ("blocks", read_blocks), ("remote", read_remote)):
        try:
            result[name] = ["ok", read(case, f"{cache}-{name}")]
        except ShardloaderError as err:
            result[name] = ["error", str(err)[:400]]
        except Exception:
            result[name] = ["traceback", traceback.format_exc()[-1500:]]
    return result


def run_child(cases: Sequence[str]) -> None:
    """The child: check each case, one JSON line each, a START line before it."""
    for case in cases:
        print("START", case, flush=True)
        with tempfile.TemporaryDirectory() as cache:
            os.environ["SHARDLOADER_CACHE_DIR"] = cache
            print("RESULT", json.dumps(check(case, os.path.join(cache, "c"))), flush=True)


def run_cases(cases: Sequence[str], timeout: float = 600) -> dict[str, dict[str, Any]]:
    """Check ``cases`` in child processes; a child that dies marks its case ``crash`` and a
    new child goes on with the rest."""
    results: dict[str, dict[str, Any]] = {}
    todo = list(cases)
    while todo:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", *todo],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},  # this shardloader
        )
        current = None
        for line in proc.stdout.splitlines():
            if line.startswith("START "):
                current = line[6:]
            elif line.startswith("RESULT ") and current is not None:
                results[current] = json.loads(line[7:])
                current = None
        if current is not None:  # died inside this case
            results[current] = {"crash": [proc.returncode, proc.stderr[-1500:]]}
        elif proc.returncode != 0 and not all(c in results for c in todo):
            raise RuntimeError(f"fuzz child failed outside a case: {proc.stderr[-2000:]}")
        todo = [c for c in todo if c not in results]
    return results


def judge(result: dict[str, Any], done: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """What is wrong with a case's outcome ([] when nothing); ``reference``: the undamaged
    dataset's ``read`` and ``blocks``."""
    shard, fixed = done["shard"], done["fixed"]
    if "crash" in result:
        return [f"crash (rc {result['crash'][0]}): {result['crash'][1][-300:]}"]
    bad = []
    stem = shard.split(".")[0]
    for name, (outcome, detail) in result.items():
        if outcome == "traceback":
            bad.append(f"{name} traceback: {detail.strip().splitlines()[-1]}")
        elif outcome == "error" and stem not in detail:
            bad.append(f"{name} error does not name {shard}: {detail}")
    same = {name: result[name] == ["ok", reference[name]] for name in reference}
    for name in reference:
        if result[name][0] == "ok" and not same[name]:
            bad.append(f"{name} passed with changed samples")
    if result["verify"][0] == "ok" and not all(same.values()):
        bad.append(f"verify passed, but: {str({n: result[n] for n in reference})[:300]}")
    if done.get("cut_stream"):
        bad += [
            f"{name} passed a cut stream" for name in ("verify", "read") if result[name][0] == "ok"
        ]
    if not fixed and done["changed"] and result["verify"][0] == "ok":
        bad.append("verify passed a shard whose checksum no longer matches")
    return bad


def templates(work: str, combos: Sequence[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Pack each combo once under ``work``; its samples and blocks, read undamaged, by combo
    name."""
    src = make_source(os.path.join(work, "src"))
    refs = {}
    for fmt, comp in combos:
        out = os.path.join(work, f"{fmt}-{comp}")
        if not os.path.exists(os.path.join(out, "index.json")):
            shutil.rmtree(out, ignore_errors=True)
            pack_template(src, out, fmt, comp)
        cache = os.path.join(work, "refcache", f"{fmt}-{comp}")
        refs[f"{fmt}-{comp}"] = {
            "read": read_samples(out, cache + "-read"),
            "blocks": read_blocks(out, cache + "-blocks"),
            "remote": read_remote(out, cache + "-remote"),
        }
    return refs


def fuzz(
    work: str,
    runs: int,
    seed: int,
    combos: Sequence[tuple[str, str]],
    fix_share: float = 0.8,
    sidecars: float = 0.25,
    hows: Sequence[str] = HOWS,
    shard: bool = True,
) -> Iterator[tuple[str, dict[str, Any], list[str]]]:
    """``runs`` cases per combo: (case, what was done, what went wrong, the outcomes)."""
    refs = templates(work, combos)
    rng = random.Random(seed)
    plan = []
    for fmt, comp in combos:
        name = f"{fmt}-{comp}"
        for r in range(runs):
            case = os.path.join(work, "cases", f"{name}-{r:04d}")
            shutil.rmtree(case, ignore_errors=True)
            shutil.copytree(os.path.join(work, name), case)
            fixed = rng.random() < fix_share
            done = mutate(case, rng, fixed, sidecars, hows, shard)
            done["fixed"] = fixed
            plan.append((case, name, done))
    results = run_cases([case for case, _, _ in plan])
    for case, name, done in plan:
        yield case, done, judge(results[case], done, refs[name]), results[case]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "fuzz-shards"))
    ap.add_argument("--runs", type=int, default=30, help="cases per format and compression")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="e.g. tar-zstd")
    ap.add_argument("--keep-checksums", action="store_true", help="leave index.json as is")
    ap.add_argument("--sidecars", type=float, default=0.25, help="share of sidecars damaged too")
    args = ap.parse_args()
    combos = [c for c in COMBOS if args.only in (None, f"{c[0]}-{c[1]}")]
    failures = 0
    share = 0.0 if args.keep_checksums else 0.8
    outcomes: dict[str, int] = {}
    for case, done, bad, result in fuzz(
        args.work, args.runs, args.seed, combos, share, args.sidecars
    ):
        if bad:
            failures += 1
            print(os.path.basename(case), json.dumps(done), *bad, sep="\n  ")
        seen = " ".join(f"{k}:{v[0]}" for k, v in result.items() if k != "inspect")
        outcomes[seen] = outcomes.get(seen, 0) + 1
    for seen, count in sorted(outcomes.items(), key=lambda x: -x[1]):
        print(f"{count:6d}  {seen}")
    print(f"{failures} bad of {args.runs * len(combos)} cases")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
