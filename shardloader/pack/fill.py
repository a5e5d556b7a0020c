"""Filling one shard's writer: each planned sample read, checked, measured, then added.

Why a module of its own: what goes into a shard (input files read and checked against the size
the plan saw, fields checked by their codec, JSON parsed once, lengths measured or text
tokenized, lines of a run checked without a sample object each, bad samples refused or
skipped) is apart from the shard's life as a file (pack/write.py: temporary name, fsync,
sidecar, resume, placing it).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from shardloader.codecs.allowlist import check_field
from shardloader.errors import InputError, StorageError
from shardloader.format.keys import unsafe_key_reason
from shardloader.pack.plan import ShardPlan
from shardloader.pack.refs import InputFile, LineRun, SampleRef, TextRule
from shardloader.pack.task import WriteSpec
from shardloader.pack.token_ids import ids_length

__all__ = ["fill_shard", "every_sample_skipped", "skip_record"]

log = logging.getLogger(__name__)

Add = Callable[[str, Mapping[str, bytes], int | None], None]  # a sample to the shard


def fill_shard(
    spec: WriteSpec,
    plan: ShardPlan,
    run_bytes: Sequence[bytes | None],
    add: Add,
    skips: list[dict[str, Any]],
) -> int:
    """Add the samples of ``plan`` through ``add`` (to the shard's writer), each read and
    checked first (``run_bytes``: each line run's byte range, None for other samples); a bad
    sample fails the shard or is recorded in ``skips`` (``spec.options.on_error``).  Returns
    the input bytes of those added."""
    bytes_in = 0
    for sample, data in zip(plan.samples, run_bytes, strict=True):
        if data is not None:
            bytes_in += _write_run(spec, sample, data, add, plan.number, skips)  # type: ignore[arg-type]
            continue
        assert isinstance(sample, SampleRef)
        try:
            fields, length = _load(spec, sample)
        except _Bad as bad:
            _refuse_or_skip(spec, bad, sample, plan.number, skips)
            continue
        add(sample.key, fields, length)
        bytes_in += _input_size(sample)
    return bytes_in


def skip_record(shard: int, file: str, where: str, reason: str, key: str = "") -> dict[str, Any]:
    """An entry of the skip report: paths relative to SRC, so reports are reproducible."""
    return {"shard": shard, "key": key, "file": file, "where": where, "reason": reason}


def every_sample_skipped(skips: Sequence[Mapping[str, Any]]) -> InputError:
    """The error of a ``--on-error skip`` run that skipped every sample: an empty dataset
    would only fail later, in training, far from the reason, which this names."""
    first = skips[0]
    where = " ".join(str(first[k]) for k in ("file", "where") if first.get(k)) or first["key"]
    return InputError(
        f"every sample was skipped ({len(skips):,} skips), nothing packed; the first, "
        f"{where}: {first['reason']}; fix the input (--on-error fail names each problem)"
    )


@functools.cache
def _tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


class _Bad(Exception):
    """A sample cannot be packed (``ref``: the file of it to blame); the caller, who knows the
    sample, makes it an InputError (fail) or a skip record (skip): :func:`_refuse_or_skip`."""

    def __init__(self, reason: str, ref: InputFile | None = None) -> None:
        super().__init__(reason)
        self.reason, self.ref = reason, ref


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _read(spec: WriteSpec, ref: InputFile) -> bytes:
    try:
        data = spec.input(ref.url).read_bytes()
    except (OSError, StorageError) as err:
        raise _Bad(f"unreadable ({err})", ref) from err
    if len(data) != ref.size:
        raise _Bad(
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
        raise _Bad(_key_reason(problem))
    cap = spec.options.max_sample_size
    if cap is not None:  # before any of it is read
        size = sum(v.size if isinstance(v, InputFile) else len(v) for _, v in sample.fields)
        if size > cap:
            refs = [v for _, v in sample.fields if isinstance(v, InputFile)]
            biggest = max(refs, key=lambda r: r.size) if refs else None  # named in the error
            raise _Bad(_too_large(size, cap), biggest)
    fields: dict[str, bytes] = {}
    parsed: dict[str, Any] = {}
    for ext, value in sample.fields:
        ref = value if isinstance(value, InputFile) else None
        data: bytes = value if ref is None else _read(spec, ref)  # type: ignore[assignment]
        parsed[ext] = _checked(spec.fields[ext].codec, ext, data, spec.options.validate, ref)
        fields[ext] = data
    return fields, _measure(spec, fields, parsed.get("json"))


def _checked(codec: str, ext: str, data: bytes, validate: bool, ref: InputFile | None) -> Any:
    """Check field ``ext`` by its codec; a JSON field is parsed (once: the text rule may need
    the value), and its value returned (None for other codecs)."""
    try:
        if codec == "json":
            return _parse_json(data)
        check_field(codec, data, validate_images=validate)
        return None
    except InputError as err:
        reason = _ADDRESS.sub("", str(err))  # PIL names object addresses: not reproducible
        raise _Bad(f"field {ext!r}: {reason}", ref) from err


def _too_large(size: int, cap: int) -> str:
    return f"the sample holds {size:,} bytes of input, more than --max-sample-size allows ({cap:,})"


def _key_reason(problem: str) -> str:
    return f"sample key {problem}; it could escape a directory when written out"


def _measure(spec: WriteSpec, fields: dict[str, bytes], value: Any) -> int | None:
    """The sample's length (text bytes or tokens; adds ``tokens`` when tokenizing)."""
    if spec.text is None:
        return None
    ids = ids_length(spec.text, spec.fields, fields)  # --token-field (pack/token_ids.py)
    if ids is not None:
        return ids
    text, what = _text_of(spec.text, fields, value)
    if spec.tokenizer is None:
        if text is None:
            return 0
        if isinstance(text, bytes):
            return len(text)
        try:
            return len(text.encode("utf-8"))
        except UnicodeEncodeError as err:  # a lone surrogate from a "\ud800" escape
            raise _Bad(f"{what} is not valid Unicode ({err.reason})") from err
    if text is None:
        raise _Bad(f"no text to tokenize ({what} is missing or not a string)")
    try:
        as_str = text if isinstance(text, str) else text.decode("utf-8")
        ids = _tokenizer(spec.tokenizer).encode(as_str).ids
    except UnicodeError as err:
        raise _Bad(f"{what} is not valid Unicode ({err})") from err
    dtype = np.dtype(spec.fields["tokens"].dtype or "uint32").newbyteorder("<")
    fields["tokens"] = np.asarray(ids, dtype=dtype).tobytes()
    return len(ids)


def _write_run(
    spec: WriteSpec, run: LineRun, data: bytes, add: Add, number: int, skips: list[dict]
) -> int:
    """Check and add the lines of ``run`` (``data``: its byte range); return input bytes.

    The per-line path of :func:`_load` for one-field record samples, without building a
    :class:`SampleRef` per line (one is built for a bad line, to name it): this is the hot
    loop of a text pack."""
    kind, stem, first = run.kind, run.stem, int(run.starts[0])
    cap, validate = spec.options.max_sample_size, spec.options.validate
    codec = spec.fields[kind].codec
    problem = unsafe_key_reason(run.key(0))  # the same for every line: only digits differ
    bytes_in = 0
    for n, s, k in zip(
        run.numbers.tolist(), run.starts.tolist(), run.lengths.tolist(), strict=True
    ):
        key = f"{stem}/{n:09d}"
        line = b""  # sliced once it is known to fit
        try:
            if problem is not None:
                raise _Bad(_key_reason(problem))
            if cap is not None and k > cap:
                raise _Bad(_too_large(k, cap))
            line = data[s - first : s - first + k]
            fields = {kind: line}
            length = _measure(spec, fields, _checked(codec, kind, line, validate, None))
        except _Bad as bad:
            sample = SampleRef(key, ((kind, line),), run.rel, f"line {n}")
            _refuse_or_skip(spec, bad, sample, number, skips)
            continue
        bytes_in += k
        add(key, fields, length)
    return bytes_in


def _refuse_or_skip(
    spec: WriteSpec, bad: _Bad, sample: SampleRef, number: int, skips: list[dict]
) -> None:
    """Fail on ``sample`` of shard ``number``, naming it, or record it in ``skips``."""
    key, ref = sample.key, bad.ref
    if ref is not None:
        message = f"{ref.url} (key {key!r}): {bad.reason}"
    elif sample.file:
        message = f"{spec.src.join(sample.file).url} {sample.where} (key {key!r}): {bad.reason}"
    else:
        message = f"sample {key!r}: {bad.reason}"
    if spec.options.on_error == "fail":
        raise InputError(f"{message}; fix or remove it, or pass --on-error skip") from None
    log.warning("skipping %s", message)
    file = ref.rel if ref is not None else sample.file
    skips.append(skip_record(number, file, sample.where, bad.reason, key))


def _input_size(sample: SampleRef) -> int:
    """Bytes the sample took from the input: its files, or its record (not derived fields)."""
    if sample.file:
        return sum(len(v) for _, v in sample.fields if isinstance(v, bytes))
    return sum(v.size for _, v in sample.fields if isinstance(v, InputFile))
