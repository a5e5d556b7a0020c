"""The pipeline a server runs, as plain values, and its fingerprint: what a client pins so that
it never continues a pass on a replica that makes other batches (NOTE [pinned pipeline]).

NOTE [pinned pipeline]: the manifest fingerprint, seed and plan say which samples a step
holds; the decoder, transform and collate say what they become.  Two replicas started with
other ``--transform`` options (or a factory whose augmentation changed) plan the same steps
but send other batches, so a client that failed over would train on a silently different
pipeline.  Every replica therefore describes its pipeline by what it *declares* (the
``serve`` options and, recursively, the type and attributes of each pipeline object; never
``repr``, which may carry memory addresses, nor anything of where the data is cached) and
hashes that description.  ``/v1/info`` sends both; the client pins the fingerprint with the
first answer and sends it with every request, and a server whose own differs answers 409 with
its description, which the client turns into the differences in words
(:func:`differences`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import types
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["describe", "differences", "fingerprint", "pipeline_spec"]

_DEPTH = 8  # pipeline objects nest (Compose of crops of ...); deeper values are named by type
_ITEMS = 64  # elements of one list or mapping described; the rest are counted


def pipeline_spec(dataset: Any, declared: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The description of ``dataset``'s pipeline: decoder, transform, collate, and the options
    ``declared`` on the command line that built it (``serve DATA --transform ...``)."""
    return {
        "options": describe(dict(declared or {})),
        "decoder": describe(dataset.decoder),
        "transform": describe(dataset.transform),
        "collate": describe(dataset.collate_fn),
    }


def fingerprint(spec: Mapping[str, Any]) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of ``spec``: equal across processes
    and hosts exactly when the descriptions are."""
    raw = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def describe(value: Any, depth: int = 0, seen: frozenset[int] = frozenset()) -> Any:
    """``value`` as JSON-able plain values that are equal across processes exactly when the
    values are declared alike: scalars as they are, containers item by item, functions and
    types by qualified name, arrays by dtype, shape and a hash of their bytes, other objects by
    type and attributes."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return {"float": value.hex()}
    if isinstance(value, enum.Enum):
        return {"enum": f"{_name(type(value))}.{value.name}"}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes": hashlib.sha256(bytes(value)).hexdigest()[:16]}
    if isinstance(value, type):
        return {"type": _name(value)}
    if id(value) in seen or depth >= _DEPTH:
        return {"object": _name(type(value))}
    seen = seen | {id(value)}
    nested = functools.partial(describe, depth=depth + 1, seen=seen)
    if isinstance(value, list | tuple):
        items = [nested(v) for v in value[:_ITEMS]]
        return items + ([f"... {len(value) - _ITEMS} more"] if len(value) > _ITEMS else [])
    if isinstance(value, Mapping):
        keys = sorted(value, key=str)
        out = {str(k): nested(value[k]) for k in keys[:_ITEMS]}
        if len(keys) > _ITEMS:
            out["..."] = f"{len(keys) - _ITEMS} more"
        return out
    if isinstance(value, set | frozenset):
        return {"set": sorted(json.dumps(nested(v), sort_keys=True) for v in value)}
    if isinstance(value, functools.partial):
        return {
            "partial": nested(value.func),
            "args": nested(value.args),
            "keywords": nested(value.keywords),
        }
    if isinstance(value, types.MethodType):
        return {"method": value.__func__.__qualname__, "of": nested(value.__self__)}
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType):
        return {"function": _name(value)}
    array = _array(value)
    if array is not None:
        return array
    attrs = _attributes(value)
    if attrs is None:
        return {"object": _name(type(value))}
    return {"object": _name(type(value)), "attrs": nested(attrs)}


def differences(mine: Any, theirs: Any, path: str = "", limit: int = 5) -> list[str]:
    """What differs between two descriptions, in words (at most ``limit`` places)."""
    out: list[str] = []
    if limit <= 0 or mine == theirs:
        return out
    if isinstance(mine, dict) and isinstance(theirs, dict) and _kind(mine) == _kind(theirs):
        for key in sorted(set(mine) | set(theirs)):
            if key not in theirs:
                out.append(f"{_join(path, key)} is {_words(mine[key])} here and absent there")
            elif key not in mine:
                out.append(f"{_join(path, key)} is absent here and {_words(theirs[key])} there")
            else:
                out += differences(mine[key], theirs[key], _join(path, key), limit - len(out))
            if len(out) >= limit:
                break
        return out[:limit]
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        for i, (x, y) in enumerate(zip(mine, theirs, strict=True)):
            out += differences(x, y, f"{path}[{i}]", limit - len(out))
        return out[:limit]
    return [f"{path or 'the pipeline'} is {_words(mine)} here, {_words(theirs)} there"]


def _kind(d: dict[str, Any]) -> Any:
    """What a described dict stands for: an object's type, or a plain mapping (None)."""
    return d.get("object") if "attrs" in d or "object" in d else None


def _join(path: str, key: str) -> str:
    if key == "attrs":  # an object's attributes read as the object's own
        return path
    return f"{path}.{key}" if path else key


def _words(value: Any) -> str:
    if isinstance(value, dict) and len(value) == 1:
        ((kind, name),) = value.items()
        if kind == "float":
            return repr(float.fromhex(name))
        return f"{kind} {name}"
    if isinstance(value, dict) and "object" in value:
        return f"a {value['object']}"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _name(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or "?"
    return f"{module}.{getattr(obj, '__qualname__', None) or type(obj).__qualname__}"


def _array(value: Any) -> dict[str, Any] | None:
    """A tensor or ndarray by dtype, shape and content hash (None: neither)."""
    try:
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            dtype, shape = str(value.dtype), list(value.shape)
        elif isinstance(value, np.ndarray):
            data, dtype, shape = np.ascontiguousarray(value), value.dtype.str, list(value.shape)
        else:
            return None
    except (RuntimeError, TypeError, ValueError):  # an array that cannot be read as bytes
        return None
    digest = hashlib.sha256(data.tobytes()).hexdigest()[:16]
    return {"array": f"{dtype}{shape} sha256:{digest}"}


def _attributes(value: Any) -> dict[str, Any] | None:
    """The attributes that configure ``value`` (dataclass fields, ``__dict__``, ``__slots__``);
    None where it has none to read (a C object: named by its type)."""
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    found: dict[str, Any] = {}
    for cls in type(value).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and slot not in ("__dict__", "__weakref__"):
                if hasattr(value, slot):
                    found[slot] = getattr(value, slot)
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        found.update(state)
    if not found and state is None:
        return None
    return {k: v for k, v in found.items() if not k.startswith("__")}
