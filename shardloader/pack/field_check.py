"""Field checks at pack time: a ``--text-field`` or ``--token-field`` that records lack.

Why a module of its own: a typo in ``--text-field``, or JSONL whose text is under another key,
used to record every length as 0 and exit 0; the planners failed only at training time.  Here
the record files are counted before anything is written: a field missing from every record of
a file is an error naming the field, the file and the fields its records do have; missing from
most records of a file, a warning with the counts.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import msgspec
from zstandard import ZstdError

from shardloader.errors import InputError, StorageError, UsageError
from shardloader.pack.layouts.base import Source
from shardloader.pack.token_ids import JSON_OBJECT, FileCount, table_columns
from shardloader.storage.store import Store

__all__ = ["check_presence", "check_text_field"]

log = logging.getLogger(__name__)

DEFAULT_TEXT_FIELD = "text"  # PackOptions.text_field's default: the text is not insisted on


def check_presence(
    counts: Sequence[FileCount],
    name: str,
    option: str,
    insisted: bool,
    note: str = "",
) -> bool:
    """Word what ``counts`` found: an error (``insisted``) or a warning for a file whose
    records all lack ``name``, a warning for one where most do (``note``: what else counts
    as missing).  Returns whether any record has it."""
    any_found = any(c.records > c.missing for c in counts)
    for c in counts:
        if not c.records:
            continue
        url = c.url or c.rel
        if c.missing == c.records and (insisted or any_found):
            have = ", ".join(repr(n) for n in sorted(c.fields)[:12]) or "no fields"
            more = ", ..." if len(c.fields) > 12 else ""
            message = (
                f"{option} {name!r} is missing from every record of {url} ({c.records:,} "
                f"records{note}); its records have {have}{more}"
            )
            if insisted:
                raise UsageError(f"{message}: pass {option} with the field that holds it")
            log.warning("%s", message)
        elif c.missing * 2 > c.records:
            log.warning("%s missing in %d of %d records of %s", name, c.missing, c.records, url)
    return any_found


def check_text_field(source: Source, text_field: str, insisted: bool) -> Source:
    """Count the records of a records source that have the text the text rule looks for;
    raise or warn (:func:`check_presence`).  Not insisted on (the default ``text``, no
    tokenizer) and in no record at all: the source without a text rule, so no length is
    recorded rather than a length of 0 for every sample."""
    from shardloader.pack.layouts.records import record_kind

    rule = source.text
    if source.layout != "records" or (rule is None and not insisted):
        return source
    json_key: str | None
    if rule is None:  # no column or field of that name at all
        columns, json_key = [text_field], text_field
    else:
        columns = [n for kind, n in rule.candidates if kind == "field"]
        json_key = next((n for kind, n in rule.candidates if kind == "json"), None)
    counts = []
    for f in source.files:
        kind = record_kind(f.rel)[0]  # type: ignore[index]
        store = source.inputs.open(f)
        try:
            if kind == "json":
                counts.append(_json_count(f.rel, f.url, store, json_key))
            elif kind != "txt":
                counts.append(table_columns(f, kind, store, columns))
        except (OSError, EOFError, InputError, StorageError, ValueError, ZstdError) as err:
            # unreadable (pyarrow's errors are ValueErrors): the pack itself
            # refuses the file, or skips it with --on-error skip, naming where it failed
            log.debug("%s: not counted (%s)", f.url, err)
    if not any(c.records for c in counts):  # only text files, or empty ones
        return source
    note = ", or holds no string" if json_key is not None else ""
    if check_presence(counts, text_field, "--text-field", insisted, note):
        return source
    log.warning(
        "no record has a %r key or column: sample lengths are not recorded; pass --text-field "
        "to name the field that holds the text",
        text_field,
    )
    return dataclasses.replace(source, text=None)


def _json_count(rel: str, url: str, store: Store, key: str | None) -> FileCount:
    """Records of a JSONL file, and those without a string under ``key`` (what the length
    measure takes); a line that is no JSON object is left to the pack to refuse or skip.

    Only ``key`` is decoded (a msgspec struct that skips the other keys: ~200 MB/s); the first
    records are decoded whole, for the names an error lists."""
    import shardloader.pack.layouts.lines as lines
    from shardloader.pack.refs import InputFile

    probe = _probe(key or "")
    count = FileCount(rel, url)
    for line in lines.iter_lines(InputFile(rel, url, 0), store):
        if not line.strip():
            continue
        try:
            found = probe.decode(line)
            if count.records < _NAMED:
                count.saw(JSON_OBJECT.decode(line))
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue
        count.records += 1
        if key is None or memoryview(found.value)[:1] != b'"':
            count.missing += 1
    return count


_NAMED = 32  # records whose keys an error lists


@functools.cache
def _probe(key: str) -> msgspec.json.Decoder:
    """A decoder of JSON objects that keeps only ``key``, raw (empty when absent)."""
    struct = msgspec.defstruct(
        "Probe", [("value", msgspec.Raw, msgspec.Raw())], rename={"value": key}
    )
    return msgspec.json.Decoder(struct)
