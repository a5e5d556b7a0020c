"""What a table's schema says as a whole, for pack (``pack/layouts/tables.py``) and for
Parquet files adopted in place (``format/parquet``) alike: the Hugging Face features in its
metadata, each column's plan (:mod:`shardloader.codecs.arrowcells` converts the cells), and the
class names of a ClassLabel column.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from shardloader.codecs.arrowcells import ColumnPlan, plan
from shardloader.errors import InputError, UsageError

__all__ = ["class_names", "hf_features", "plan_columns"]

log = logging.getLogger(__name__)


def hf_features(schema: Any) -> dict[str, Any]:
    """The Hugging Face features of a table (``{column: feature}``), {} when it has none.

    Metadata that is not the JSON ``datasets`` writes is an InputError (the caller names the
    file): the features choose the columns' codecs and the class names, which would otherwise
    be lost without a word."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw is None:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError as err:  # UnicodeDecodeError too
        raise _damaged(f"is not valid JSON ({err})") from err
    info = doc.get("info", {}) if isinstance(doc, dict) else None
    features = info.get("features", {}) if isinstance(info, dict) else None
    if not isinstance(features, dict):
        raise _damaged("has no mapping of columns to features at info.features")
    return features


def _damaged(what: str) -> InputError:
    return InputError(
        f"its 'huggingface' schema metadata {what}; write the file again with `datasets`, or "
        "without that metadata"
    )


_LABEL_NAMES = ("label", "labels", "cls", "class")  # preferred when several ClassLabel columns


def plan_columns(
    schema: Any, features: Mapping[str, Any], unsupported: Callable[[str], Exception]
) -> dict[str, ColumnPlan]:
    """Each column's plan, sorted by name (pack and ``index`` convert cells alike); a column no
    plan keeps faithfully raises ``unsupported(message)``, two columns of one name UsageError
    (the caller names the file: :func:`~shardloader.errors.located`)."""
    out: dict[str, ColumnPlan] = {}
    for column in schema:
        if column.name in out:
            raise UsageError(f"two columns are named {column.name!r}; rename one")
        feature = features.get(column.name)
        found = plan(column.name, column.type, feature if isinstance(feature, dict) else None)
        if found is None:
            raise unsupported(
                f"column {column.name!r} has Arrow type {column.type}, which "
                "shardloader cannot store faithfully"
            )
        out[column.name] = found
    return dict(sorted(out.items()))


def class_names(features: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """The names of a table's ClassLabel column (``label`` first when there are several); names
    that are no list of strings: InputError, as for :func:`hf_features`."""
    labels = {}
    for column, feature in features.items():
        if isinstance(feature, dict) and feature.get("_type") == "ClassLabel":
            names = feature.get("names") or []
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise _damaged(f"gives ClassLabel {column!r} names that are no list of strings")
            labels[column] = tuple(names)
    if not labels:
        return ()
    name = next((n for n in _LABEL_NAMES if n in labels), next(iter(labels)))
    if len(labels) > 1:
        log.warning(
            "%s: several ClassLabel columns (%s); the manifest's classes are those of %r",
            where,
            ", ".join(labels),
            name,
        )
    return labels[name]
