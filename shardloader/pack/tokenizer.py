"""``--tokenizer`` and ``--token-field``: where a pack's token ids come from, decided once, up
front, in the main process (:func:`token_source`).

``--tokenizer``: the pack workers load the same file themselves (pack/fill.py); here the main
process checks that it loads, records its sha256 and vocabulary size for the manifest, and adds
the ``tokens`` field (uint16 ids when the vocabulary fits, else uint32).

``--token-field``: the ids are in the input already (pack/token_ids.py); they are scanned here,
the vocabulary size taken from ``--vocab-size`` or the largest id, and the source's records
read through ``TokenRecords``.  Either way the manifest's ``extra["tokenizer"]["vocab_size"]``
is the vocabulary size, so the documented ``pad_id = vocab_size`` recipe works on both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import TYPE_CHECKING, Any

from shardloader.errors import UsageError
from shardloader.manifest import FieldInfo
from shardloader.storage.store import Store

if TYPE_CHECKING:
    from shardloader.pack.layouts.base import Source
    from shardloader.pack.options import PackOptions

__all__ = ["add_tokens", "pretokenized", "token_source"]


def add_tokens(src: str, path: str | None, fields: dict[str, FieldInfo]) -> dict | None:
    """Add the ``tokens`` field for ``--tokenizer`` (a local tokenizers JSON file, loaded once
    here to check it); return what the manifest records of it: its sha256 and vocabulary
    size (and where it is, for the pack workers)."""
    from shardloader.pack.token_ids import ids_dtype

    if path is None:
        return None
    if "tokens" in fields:
        raise UsageError(f"{src} already has a 'tokens' field; --tokenizer would replace it")
    where = Store(path)
    if not where.is_local:
        raise UsageError(f"--tokenizer {path!r}: give a local tokenizer.json file")
    try:
        with open(where.local_path, "rb") as f:
            data = f.read()
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(data.decode("utf-8"))
    except ImportError as err:
        raise UsageError(
            "--tokenizer needs the tokenizers package: pip install 'shardloader[text]'"
        ) from err
    except Exception as err:  # OSError, bad UTF-8, and tokenizers' own untyped errors
        raise UsageError(f"--tokenizer {path!r}: cannot load ({err})") from err
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    fields["tokens"] = FieldInfo("tokens", ids_dtype(vocab))
    sha = hashlib.sha256(data).hexdigest()
    return {"sha256": sha, "vocab_size": vocab, "path": os.path.abspath(where.local_path)}


def token_source(
    src: str, source: Source, options: PackOptions
) -> tuple[Source, dict[str, FieldInfo], dict | None]:
    """The source as the pack reads it, its fields, and what the manifest records of its
    token ids (None: no tokens); the text or token field checked (pack/field_check.py)."""
    from shardloader.pack.field_check import DEFAULT_TEXT_FIELD, check_text_field

    if options.token_field is not None:
        source, meta = pretokenized(src, source, options.token_field, options.vocab_size)
        return source, dict(source.fields), meta
    insisted = options.tokenizer is not None or options.text_field != DEFAULT_TEXT_FIELD
    source = check_text_field(source, options.text_field, insisted)
    fields = dict(source.fields)
    return source, fields, add_tokens(src, options.tokenizer, fields)


def pretokenized(
    src: str, source: Source, name: str, vocab_size: int | None
) -> tuple[Source, dict[str, Any]]:
    """``--token-field name``: every record file's ids scanned and checked, the ``tokens``
    field (in place of ``name``) with the dtype the vocabulary needs."""
    from shardloader.pack.field_check import check_presence
    from shardloader.pack.layouts.records import TokenRecords, record_kind
    from shardloader.pack.token_ids import IdsRule, ids_dtype, scan_ids

    if source.layout != "records":
        raise UsageError(
            f"--token-field reads token ids from record files (JSONL, Parquet, Arrow), but "
            f"{src} is laid out as {source.layout}; pass --layout records if they are records"
        )
    counts, kinds, keep_json = [], set(), False
    for f in source.files:
        kind = record_kind(f.rel)[0]  # type: ignore[index]
        kinds.add(kind)
        counts.append(scan_ids(f, kind, source.inputs.open(f), name, vocab_size))
        keep_json |= kind == "json" and bool(counts[-1].fields)  # other keys beside the ids
    if not check_presence(counts, name, "--token-field", insisted=True):
        raise UsageError(f"--token-field {name!r}: {src} holds no records")
    # at most 2**32 either way: PackOptions refuses a larger --vocab-size, scan_ids larger ids
    vocab = vocab_size if vocab_size is not None else max(max(c.hi for c in counts) + 1, 1)
    dtype = ids_dtype(vocab)
    fields = {k: v for k, v in source.fields.items() if k != name}
    if kinds == {"json"} and not keep_json:
        fields.pop("json", None)  # the records held nothing but their ids
    if "tokens" in fields:
        raise UsageError(
            f"{src} already has a 'tokens' field; --token-field {name!r} would replace it"
        )
    fields["tokens"] = FieldInfo("tokens", dtype)
    rule = IdsRule(name, dtype, vocab, keep_json)
    source = dataclasses.replace(
        source, impl=TokenRecords(rule), fields=fields, text=rule.text_rule()
    )
    return source, {"sha256": None, "vocab_size": vocab, "path": None, "token_field": name}
