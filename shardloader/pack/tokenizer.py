"""``--tokenizer``: the tokenizer file a pack uses, checked and described once, up front.

The pack workers load the same file themselves (pack/fill.py); here the main process checks
that it loads, records its sha256 and vocabulary size for the manifest, and adds the ``tokens``
field (uint16 ids when the vocabulary fits, else uint32).
"""

from __future__ import annotations

import hashlib
import os

from shardloader.errors import UsageError
from shardloader.manifest import FieldInfo
from shardloader.storage.store import Store

__all__ = ["add_tokens", "tokenizer_info"]


def tokenizer_info(path: str) -> tuple[str, int]:
    """(sha256 of the file, vocabulary size) of a local tokenizers JSON file."""
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
    return hashlib.sha256(data).hexdigest(), int(tok.get_vocab_size(with_added_tokens=True))


def add_tokens(src: str, tokenizer: str | None, fields: dict[str, FieldInfo]) -> dict | None:
    """Add the ``tokens`` field for ``--tokenizer``; return what the manifest records of it."""
    if tokenizer is None:
        return None
    if "tokens" in fields:
        raise UsageError(f"{src} already has a 'tokens' field; --tokenizer would replace it")
    sha, vocab = tokenizer_info(tokenizer)
    fields["tokens"] = FieldInfo("tokens", "uint16" if vocab <= 1 << 16 else "uint32")
    return {
        "sha256": sha,
        "vocab_size": vocab,
        "path": os.path.abspath(Store(tokenizer).local_path),
    }
