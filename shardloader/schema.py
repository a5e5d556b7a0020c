"""What ``index.json`` and the ``*.idx.arrow`` sidecars may contain, checked before use.

A downloaded dataset is untrusted input.  Every manifest value is checked for its JSON type and
range on load, and the first problem is reported as a :class:`ManifestError` with its JSON path
(``index.json: shards[3].num_samples: expected a non-negative integer, got "12"``), so that no
reader sizes an array, opens a path or loops over a count that the checks have not seen.

Counts are checked against sizes, with the facts each shard format states (format/base.py): a
tar sample takes at least one 512-byte header block and a tar ends with at least one zero
block, so a tar shard of ``raw_bytes`` R holds at most ``(R - 512) // 512`` samples; an Arrow
row has a non-empty key, so at most ``raw_bytes`` rows.  ``raw_bytes`` itself is bounded by the
stored size times the largest expansion the codec can produce (zstd: a 4-byte RLE block expands
to 128 KiB; deflate: 1032x), and no shard may claim more than 16 TiB or 2**32 samples
(:data:`MAX_SHARD_BYTES`, :data:`MAX_SHARD_SAMPLES`), so no claim sizes a read or an array
past what a node could hold.  Paths are checked percent-decoded too: a remote manifest is held
to the same rule as a local one.  A sidecar is checked against its shard's entry (count, byte
ranges inside ``raw_bytes``, safe keys) when the shard is first used, before its offsets are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from shardloader.errors import ManifestError
from shardloader.format.keys import check_key, first_unsafe_key, unsafe_key_reason
from shardloader.format.registry import get_format, known_formats

if TYPE_CHECKING:
    from shardloader.format.base import Format
    from shardloader.manifest import SampleIndex, ShardInfo

__all__ = [
    "MAX_EXPANSION",
    "MAX_SHARD_BYTES",
    "MAX_SHARD_SAMPLES",
    "check_format",
    "check_manifest_dict",
    "check_sample_index",
    "sidecar_bound",
]

# Largest uncompressed/stored ratio a codec can produce (plus a little for headers).
MAX_EXPANSION = {"zstd": 32768, "gzip": 1032, "none": 1}
_SLACK = 64 << 10
# What no shard can be, whatever its manifest says: checked before any size is used for a read
# or an allocation.  16 TiB is the largest file ext4 holds and more than one node stages; a
# sample index of 2**32 rows would take over 100 GB.
MAX_SHARD_BYTES = 1 << 44
MAX_SHARD_SAMPLES = 1 << 32
_INT_MAX = 2**63 - 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TOKEN_DTYPES = frozenset(
    {"uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"}
)
_SHARD_KEYS = ("path", "num_samples", "bytes", "raw_bytes", "sha256", "index_path", "index_sha256")
_FIELD_KEYS = ("codec", "dtype")


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(path: str, problem: str) -> ManifestError:
    return ManifestError(f"{path}: {problem}")


def _expect(path: str, what: str, value: Any) -> ManifestError:
    return _fail(path, f"expected {what}, got {_show(value)}")


def _count(path: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT_MAX:
        raise _expect(path, "a non-negative integer", value)
    return value


def _string(path: str, value: Any, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise _expect(path, "a string" if empty else "a non-empty string", value)
    return value


def _obj(path: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _expect(path, "an object", value)
    return value


def _array(path: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise _expect(path, "an array", value)
    return value


def _known_keys(path: str, entry: dict[str, Any], known: tuple[str, ...]) -> None:
    for key in entry:
        if key not in known:
            raise _fail(f"{path}.{key}", f"unknown key (known: {', '.join(known)})")


def _sha256(path: str, value: Any) -> str:
    if not isinstance(value, str) or not _SHA256.match(value):
        raise _expect(path, "a sha256 (64 lower-case hex digits)", value)
    return value


def _rel_path(path: str, value: Any) -> str:
    problem = _path_problem(_string(path, value, empty=False))
    if problem is not None:
        raise _fail(
            path,
            f"{_show(value)} {problem}; paths in a manifest are relative to its folder and stay "
            "inside it",
        )
    return value


def _path_problem(path: str) -> str | None:
    """Why a manifest path (shard, sidecar, report) could leave the dataset folder, or None.

    A path is checked as a file name and as the end of a URL alike, whatever store the dataset
    is read from now (the same manifest may be served over HTTP later): a server that decodes
    percent-escapes and normalises paths (nginx does) turns ``%2e%2e/x`` into ``../x``, and
    Tomcat reads ``..;x`` as ``..``.  So the decoded forms are checked too (escapes decoded up
    to :data:`_DECODINGS` times, for servers that decode twice), and ``?``, ``#`` and control
    characters, which end or break a URL's path, are refused.
    """
    if "://" in path:
        return "is a URL"
    if _CONTROL.search(path):
        return "contains a control character"
    if "?" in path or "#" in path:
        return "contains '?' or '#', which would end the path of a URL"
    form = path
    for _ in range(_DECODINGS):
        reason = unsafe_key_reason(form) or _param_reason(form)
        if reason is not None:
            return reason if form == path else f"decodes to {form!r}, which {reason}"
        decoded = unquote(form)
        if decoded == form:
            return None
        form = decoded
        if "://" in form or _CONTROL.search(form):
            return f"decodes to {form!r}, a URL or control characters"
    return f"is still percent-encoded after {_DECODINGS} decodings"


_DECODINGS = 3
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _param_reason(path: str) -> str | None:
    """A component that is ``..`` once its ``;parameters`` are cut off (``..;x``)."""
    if ";" in path and any(part.split(";", 1)[0] == ".." for part in path.split("/")):
        return "has a '..;' component"
    return None


def check_format(name: str, compression: str) -> Format:
    """The registered format ``name``, if ``compression`` is one of its; else a
    :class:`ManifestError` naming the manifest key (``format``, ``compression``)."""
    if name not in known_formats():
        raise _fail(
            "format",
            f"unknown shard format {name!r}; known: {', '.join(known_formats())} (a "
            "third-party format must be registered before its datasets are read)",
        )
    fmt = get_format(name)
    if compression not in fmt.compressions:
        raise _fail(
            "compression",
            f"{compression!r} is not one of {', '.join(fmt.compressions)} for {name} shards",
        )
    return fmt


def check_manifest_dict(raw: Mapping[str, Any]) -> None:
    """Raise :class:`ManifestError` at the first value of a parsed manifest that is wrong,
    named by its JSON path (the caller adds the file: :func:`~shardloader.errors.located`)."""
    from shardloader.codecs.allowlist import _CODECS

    name = _string("format", raw.get("format"))
    compression = _string("compression", raw.get("compression"))
    fmt = check_format(name, compression)
    if "layout" in raw:
        _string("layout", raw["layout"])
    if raw.get("checksum_algorithm", "sha256") != "sha256":
        raise _expect("checksum_algorithm", '"sha256"', raw["checksum_algorithm"])
    if raw.get("length_field") is not None:
        _string("length_field", raw["length_field"], empty=False)

    fields = _obj("fields", raw.get("fields"))
    for name, info in fields.items():
        path = f"fields[{_show(name)}]"
        if not name or "/" in name or unsafe_key_reason(name) is not None:
            raise _fail(path, "a field name must be a non-empty string without '/', '\\' or NUL")
        _known_keys(path, _obj(path, info), _FIELD_KEYS)
        codec = _string(f"{path}.codec", info.get("codec"))
        if codec not in _CODECS:
            raise _expect(f"{path}.codec", f"one of {', '.join(_CODECS)}", codec)
        dtype = info.get("dtype")
        if dtype is not None and (codec != "tokens" or dtype not in _TOKEN_DTYPES):
            what = (
                f"an integer type ({', '.join(sorted(_TOKEN_DTYPES))})"
                if codec == "tokens"
                else f"no dtype for codec {codec!r}"
            )
            raise _expect(f"{path}.dtype", what, dtype)

    for i, name in enumerate(_array("classes", raw.get("classes", []))):
        _string(f"classes[{i}]", name)
    _check_extra(_obj("extra", raw.get("extra", {})))
    for name, exts in _obj("aliases", raw.get("aliases", {})).items():
        path = f"aliases[{_show(name)}]"
        if not name:
            raise _fail(path, "an alias name must be a non-empty string")
        for j, ext in enumerate(_array(path, exts)):
            _string(f"{path}[{j}]", ext, empty=False)

    shards = _array("shards", raw.get("shards"))
    total = stored = unpacked = 0
    for i, entry in enumerate(shards):
        n, size, raw_size = _check_shard(f"shards[{i}]", entry, fmt, compression)
        total, stored, unpacked = total + n, stored + size, unpacked + raw_size
    for key, value in (
        ("num_samples", total),
        ("num_shards", len(shards)),
        ("bytes", stored),
        ("raw_bytes", unpacked),
    ):
        if key not in raw and key != "num_samples":
            continue
        if _count(key, raw.get(key)) != value:
            raise _fail(
                key,
                f"{raw[key]} does not equal the shards' total ({value}); the "
                "manifest was edited or damaged",
            )


def _check_extra(extra: dict[str, Any]) -> None:
    if "skipped" in extra:
        _count("extra.skipped", extra["skipped"])
    checks = {"skip_report": _rel_path, "length_unit": _string, "tokenizer": _obj, "part": _obj}
    for key, check in checks.items():
        if extra.get(key) is not None:
            check(f"extra.{key}", extra[key])


def _check_shard(path: str, entry: Any, fmt: Format, compression: str) -> tuple[int, int, int]:
    _obj(path, entry)
    for key in _SHARD_KEYS:
        if key not in entry:
            raise _fail(f"{path}.{key}", "missing")
    _known_keys(path, entry, _SHARD_KEYS)
    _rel_path(f"{path}.path", entry["path"])
    _rel_path(f"{path}.index_path", entry["index_path"])
    _sha256(f"{path}.sha256", entry["sha256"])
    _sha256(f"{path}.index_sha256", entry["index_sha256"])
    n = _count(f"{path}.num_samples", entry["num_samples"])
    size = _count(f"{path}.bytes", entry["bytes"])
    raw = _count(f"{path}.raw_bytes", entry["raw_bytes"])
    name = f"{path} ({entry['path']})"
    if raw > size * MAX_EXPANSION[compression] + _SLACK:
        raise _fail(
            f"{name}.raw_bytes",
            f"{raw:,} uncompressed bytes cannot come from {size:,} stored "
            f"bytes of {compression} (at most {MAX_EXPANSION[compression]}x)",
        )
    problem = fmt.entry_problem(n, size, raw, compression)
    if problem is not None:
        raise _fail(f"{name}.{problem[0]}", problem[1])
    too_big = "16 TiB, more than a node can stage"
    for key, value, most, unit, why in (
        ("bytes", size, MAX_SHARD_BYTES, "bytes", too_big),
        ("raw_bytes", raw, MAX_SHARD_BYTES, "bytes", too_big),
        ("num_samples", n, MAX_SHARD_SAMPLES, "samples", "2**32, a sample index past 100 GB"),
    ):
        if value > most:
            raise _fail(
                f"{name}.{key}",
                f"{value:,} {unit} is more than any shard can hold (at most {most:,}: {why}); "
                "the manifest is damaged or hostile",
            )
    return n, size, raw


def sidecar_bound(info: ShardInfo) -> int:
    """Most bytes a shard's sidecar may take, stored or decompressed.

    Its keys are inside the shard's raw bytes (tar member names, the Arrow key column); the
    other columns take under 48 bytes a sample.
    """
    return info.raw_bytes + 48 * info.num_samples + (1 << 20)


def check_sample_index(index: SampleIndex, fmt: str, info: ShardInfo) -> None:
    """Check a sidecar against its shard's manifest entry before any of it is used (the caller
    names the sidecar: :func:`~shardloader.errors.located`).  Count and byte ranges are
    :class:`ManifestError`; an unsafe key is :class:`ShardError`."""
    n = len(index)
    if n != info.num_samples:
        raise ManifestError(
            f"the sample index lists {n} samples, the manifest {info.num_samples}; the "
            "sidecar does not belong to this shard: re-pack or re-index the dataset"
        )
    columns = (index.keys, index.sizes, index.lengths, index.checksums)
    if any(c is not None and len(c) != n for c in columns):
        raise ManifestError("the sample index has columns of different lengths")
    if n:
        if int(index.offsets.min()) < 0 or int(index.sizes.min()) < 0:
            raise ManifestError("the sample index has negative offsets or sizes")
        if index.lengths is not None and int(index.lengths.min()) < 0:
            raise ManifestError("the sample index has negative lengths")
        problem = get_format(fmt).index_problem(index, info)
        if problem is not None:
            raise ManifestError(problem)
    unsafe = first_unsafe_key(list(index.keys))
    if unsafe is not None:
        check_key(unsafe[0])
