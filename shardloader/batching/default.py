"""The default collate rules: a list of sample dicts in, one batch dict of tensors out.

Every collate of shardloader (PadCollate, PackCollate, DetectionCollate) runs in the worker and
builds on these rules (``default_collate`` semantics, made explicit):

* numbers (Python int, float, bool; numpy scalars) stack into a 1-D tensor as
  ``torch.utils.data.default_collate`` stacks them: int → int64, float → float64, bool → bool,
  numpy scalars keep their dtype.  One exception: a field that mixes floats with other number
  types is float64 whatever the order (torch follows the first value: ``[1, 2.5]`` would be
  float32 and ``[2.5, 1]`` float64, so the dtype would change with the shuffle);
* tensors (0-d too) and numpy arrays of equal shape stack; lists/tuples of numbers count as
  1-D arrays;
* strings, bytes, ``None`` and anything else stay a Python list; dicts recurse (a nested
  field is named by its dotted path, e.g. ``"meta.ids"``);
* a field whose arrays differ in shape is padded only when it has an explicit pad value;
* a sample may lack a field or hold ``None`` there (NOTE [missing values]).

NOTE [missing values]
    The batch holds the union of its samples' fields: a field is never dropped because the
    first sample lacks it.  Where a value is missing (absent or ``None``) the field is a list
    with ``None`` in that place, unless the values present would stack into a tensor (numbers,
    arrays, lists of numbers): a tensor has no place for a missing value, so that is a
    :class:`~shardloader.errors.MissingFieldError` naming the field, how many samples lack it
    and the first one, and the remedy: ``Decoder(fill=...)`` or ``Decoder(required=...)``
    (:mod:`shardloader.read.fields`).  Batches of one field then have one type whichever
    samples they hold.

NOTE [pad values are explicit]
    Every variable-length field needs an explicit pad value: a missing one is a
    :class:`~shardloader.errors.UsageError` that names the field and the remedy, never a silent
    ``0``.  That covers integer token fields (``0`` is often a real token id) and also float
    sequences: one rule is easier to remember than a dtype-dependent default, and a float
    feature padded with ``0.0`` is just as wrong when the model ignores the mask.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from itertools import chain, repeat
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from shardloader.errors import MissingFieldError, UsageError

__all__ = ["collate_samples", "missing_field", "torch_collate"]


_NUMBERS = (int, float, np.bool_, np.number)  # what default_collate stacks as numbers


def is_number(v: Any) -> bool:
    return isinstance(v, _NUMBERS)  # bool too: an int


def is_array(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray))


def is_number_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(is_number(x) for x in v)


def to_tensor(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, np.ndarray):
        if not v.flags.writeable:  # e.g. np.frombuffer over read bytes: torch would warn
            return torch.from_numpy(v.copy())
        return torch.from_numpy(np.ascontiguousarray(v))
    return torch.as_tensor(v)


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(v.shape) if is_array(v) else (len(v),)


def collate_samples(
    samples: Sequence[Mapping[str, Any]],
    *,
    pad: Mapping[str, Any] | None = None,
    ragged: str = "error",
) -> dict[str, Any]:
    """Collate sample dicts with the module's default rules.

    ``pad`` maps a dotted field name to a function ``(name, values) -> value`` that collates
    that field instead (PadCollate passes its padder).  ``ragged`` says what happens to arrays
    of unequal shapes without one: ``"error"`` or ``"list"`` (keep them as a list).  Samples
    may lack fields (NOTE [missing values]).
    """
    if not samples:
        raise UsageError("cannot collate an empty batch")
    if ragged not in ("error", "list"):
        raise UsageError(f"ragged={ragged!r} is not 'error' or 'list'")
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping):
            raise UsageError(f"sample {i} is a {type(s).__name__}, not a dict; collate dicts")
    return _collate_dicts(samples, samples, "", pad or {}, _stacker(ragged))


def _union(samples: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every field of the batch, in the order the samples first name them."""
    first = samples[0].keys()
    if all(s.keys() == first for s in samples):
        return list(first)
    return list(dict.fromkeys(k for s in samples for k in s))


def _collate_dicts(
    dicts: Sequence[Mapping[str, Any]],
    owners: Sequence[Any],
    prefix: str,
    pad: Mapping[str, Any],
    leaf: Callable[[str, list[Any]], Any],
) -> dict[str, Any]:
    """The union of the dicts' fields (NOTE [missing values]), nested dicts field by field, a
    field none of whose values is missing by ``pad[name]`` or ``leaf(name, values)``
    (``owners``: the batch's samples, named by a missing-field error)."""
    out: dict[str, Any] = {}
    for key in _union(dicts):
        name = f"{prefix}{key}"
        values = [d.get(key) for d in dicts]
        present = [v for v in values if v is not None]
        if name not in pad and present and all(isinstance(v, Mapping) for v in present):
            nested = [{} if v is None else v for v in values]
            out[key] = _collate_dicts(nested, owners, f"{name}.", pad, leaf)
        elif len(present) < len(values):
            if name in pad or (present and _tensor_kind(present)):
                raise missing_field(name, values, owners)
            out[key] = list(values)
        else:
            out[key] = pad.get(name, leaf)(name, values)
    return out


def _stacker(ragged: str) -> Callable[[str, list[Any]], Any]:
    """The default rules for one field whose values are all present (module docstring)."""

    def stack(name: str, values: list[Any]) -> Any:
        kind = _tensor_kind(values)
        if kind == "numbers":
            return _stack_numbers(values)
        if kind == "arrays":
            shapes = {_shape(v) for v in values}
            if len(shapes) == 1:
                # torch's default_collate stacks straight into shared memory inside a
                # DataLoader worker, saving a copy of every image batch on its way to the
                # main process
                return default_collate([to_tensor(v) for v in values])
            if ragged == "list":
                return list(values)
            raise UsageError(_ragged_message(name, values))
        return list(values)

    return stack


def _stack_numbers(values: list[Any]) -> torch.Tensor:
    types = set(map(type, values))
    if len(types) > 1 and any(issubclass(t, (float, np.floating)) for t in types):
        return torch.tensor([float(v) for v in values], dtype=torch.float64)  # order-free
    return default_collate(values)


def _tensor_kind(values: Sequence[Any]) -> str | None:
    """What the default rules make of these values (none missing): ``"numbers"`` (one 1-D
    tensor), ``"arrays"`` (tensors, numpy arrays and lists of numbers, not all empty: stacked
    when their shapes agree), or None: they stay a list.  The one rule for both a full field
    and one with missing values (NOTE [missing values]: those of a tensor field are an error)."""
    if all(is_number(v) for v in values):
        return "numbers"
    if all(is_array(v) or is_number_list(v) for v in values) and any(
        is_array(v) or v for v in values
    ):
        return "arrays"
    return None


def missing_field(name: str, values: Sequence[Any], owners: Sequence[Any]) -> MissingFieldError:
    """The error for field ``name`` of a batch, missing (``None``) in some of ``values`` while
    the others stack into a tensor; ``owners`` are the batch's samples (their ``__key__`` and
    ``__index__`` say which sample).  The dataset adds the shard (:func:`shardloader.read.
    fields.placed`)."""
    lacking = [i for i, v in enumerate(values) if v is None]
    first = owners[lacking[0]] if lacking and lacking[0] < len(owners) else None
    key = first.get("__key__") if isinstance(first, Mapping) else None
    index = first.get("__index__") if isinstance(first, Mapping) else None
    index = int(index) if isinstance(index, (int, np.integer, torch.Tensor)) else None
    sample = f"sample {key!r}" if key is not None else f"sample {lacking[0]} of the batch"
    return MissingFieldError(
        f"field {name!r} is missing (absent or null) in {len(lacking)} of {len(values)} "
        f"samples of the batch, first in {sample}, and its other values stack into a tensor, "
        f"which has no place for a missing value: fill it (Decoder(fill={{{name!r}: ...}}); "
        f"`--fill {name}=VALUE` in `shardloader serve`) or refuse samples without it "
        f"(Decoder(required=({name!r},)), with on_error='skip' to skip them; `--require "
        f"{name}`)",
        field=name,
        missing=len(lacking),
        key=None if key is None else str(key),
        index=index,
    )


def _ragged_message(name: str, values: list[Any]) -> str:
    shapes = [_shape(v) for v in values]
    if len({s[1:] for s in shapes}) == 1:
        lo, hi = min(s[0] for s in shapes), max(s[0] for s in shapes)
        return (
            f"field {name!r} has variable length ({lo}..{hi}) and no pad value: pass "
            f"PadCollate(pad_values={{{name!r}: ...}}) with the value to pad it with (the "
            "tokenizer's pad id for token ids, -100 for labels); shardloader never pads with "
            "an implicit 0"
        )
    return (
        f"field {name!r} has arrays of different shapes ({shapes[0]} and "
        f"{next(s for s in shapes if s != shapes[0])}) that cannot be stacked or padded along "
        "the first dimension; resize them in the transform (e.g. shardloader.vision), or use "
        "DetectionCollate, which keeps such fields as lists"
    )


def torch_collate(samples: Sequence[Any]) -> Any:
    """torch's ``default_collate`` (the dataset's collate when none is given), for batches
    whose samples may lack fields (NOTE [missing values]: the union of the fields, ``None``
    where a value is missing), with its shape errors ("stack expects each tensor to be equal
    size") turned into one that names the field, the sizes and the samples, and says what to
    do."""
    samples = list(samples)
    if samples and all(isinstance(s, Mapping) for s in samples) and not _complete(samples):
        return _collate_dicts(samples, samples, "", {}, partial(_torch_field, owners=samples))
    return _torch_field("", samples, samples)


def _complete(dicts: Sequence[Mapping[str, Any]]) -> bool:
    """Every dict has the same fields, none of them ``None``, nested dicts alike: what
    ``default_collate`` takes as it is (it reads the first sample's fields only).  Checked for
    every batch, so in C where it can be (``is``, never ``==`` on arrays)."""
    first = dicts[0]
    keys = first.keys()
    if any(d.keys() != keys for d in dicts):
        return False
    values = chain.from_iterable(d.values() for d in dicts)
    if any(map(operator.is_, values, repeat(None))):  # ~0.1 us a value (`None in` is slower)
        return False
    for key, value in first.items():
        if isinstance(value, dict) or isinstance(value, Mapping):  # dict first: the ABC is slow
            inner = [d[key] for d in dicts]
            if not all(isinstance(v, dict) or isinstance(v, Mapping) for v in inner):
                return False
            if not _complete(inner):
                return False
    return True


def _torch_field(name: str, values: list[Any], owners: Sequence[Any]) -> Any:
    """``default_collate(values)`` (``name``: the dotted field, "" for whole samples).  Where it
    fails, the batch is collated field by field, so that the field is kept or named: values it
    refuses (``datetime``, ``Decimal``: what Parquet timestamp and decimal columns decode to)
    stay a list, as strings do; arrays of unequal shapes and lists of unequal lengths are a
    :class:`UsageError` naming the field, two samples and the remedy."""
    try:
        return default_collate(values)
    except (RuntimeError, TypeError) as err:
        if values and all(isinstance(v, Mapping) for v in values):
            prefix = f"{name}." if name else ""
            return _collate_dicts(values, owners, prefix, {}, partial(_torch_field, owners=owners))
        if any(v is not None and not isinstance(v, _TORCH_TAKES) for v in values):
            return list(values)
        keys = [_key(s, i) for i, s in enumerate(owners)]
        if all(is_array(v) for v in values):
            shapes = [tuple(v.shape) for v in values]
            j = next((j for j, sh in enumerate(shapes) if sh != shapes[0]), None)
            if j is not None and all(len(sh) == 1 for sh in shapes):  # token ids, features
                raise UsageError(
                    f"cannot batch field {name!r}: sample {keys[0]!r} holds {shapes[0][0]} values "
                    f"and sample {keys[j]!r} {shapes[j][0]}; pad variable-length sequences with "
                    f"collate_fn=PadCollate(pad_values={{{name!r}: ...}}) (the tokenizer's pad id "
                    "for token ids), or pack them: batching.PackedBatches"
                ) from err
            if j is not None:
                raise UsageError(
                    f"cannot batch field {name!r}: sample {keys[0]!r} has shape {shapes[0]} and "
                    f"sample {keys[j]!r} has shape {shapes[j]}; images need one size in a batch: "
                    "resize them in the transform (shardloader.vision.train_transform(224) or "
                    "eval_transform(224); `--transform auto` in `shardloader serve`/`bench`), or "
                    "pass collate_fn=PadCollate(pad_values={...}) for variable-length sequences"
                ) from err
        if all(isinstance(v, list | tuple) for v in values):
            sizes = [len(v) for v in values]
            j = next((j for j, n in enumerate(sizes) if n != sizes[0]), None)
            if j is not None:
                raise UsageError(
                    f"cannot batch field {name!r}: sample {keys[0]!r} holds a list of {sizes[0]} "
                    f"and sample {keys[j]!r} one of {sizes[j]}; torch's default_collate takes "
                    "lists of one length only (it transposes them): pass collate_fn=shardloader."
                    "collate.collate_samples, which keeps a list per sample (a Parquet list of "
                    f"strings), or PadCollate(pad_values={{{name!r}: ...}}) for lists of numbers"
                ) from err
        raise


def _key(sample: Any, i: int) -> Any:
    """What names sample ``i`` of a batch in an error: its key, else its place."""
    key = sample.get("__key__") if isinstance(sample, Mapping) else None
    return i if key is None else key


_TORCH_TAKES = (torch.Tensor, np.ndarray, np.generic, int, float, str, bytes, Mapping, Sequence)


def as_array(name: str, v: Any) -> np.ndarray | torch.Tensor:
    if is_array(v):
        if v.ndim == 0:
            raise UsageError(f"field {name!r} has a scalar where a sequence is padded")
        if isinstance(v, np.ndarray) and v.dtype.kind not in "biuf":
            raise UsageError(
                f"field {name!r}: cannot pad an array of {v.dtype} (numbers only); keep such "
                "fields out of pad_values"
            )
        return v
    if is_number_list(v):
        return np.asarray(v)
    raise UsageError(f"field {name!r}: cannot pad a {type(v).__name__}; give arrays or lists")


def result_dtype(name: str, arrays: Sequence[Any], pad_value: Any) -> torch.dtype:
    """int64 for integer data (token ids, labels with -100), the input dtype otherwise."""
    arrays = [a for a in arrays if a.shape[0]] or list(arrays)  # [] has no meaningful dtype
    kinds = {a.dtype.kind if isinstance(a, np.ndarray) else _torch_kind(a.dtype) for a in arrays}
    if kinds <= {"i", "u"}:
        if not float(pad_value).is_integer():
            raise UsageError(f"field {name!r} holds integers but its pad value is {pad_value!r}")
        return torch.int64
    if kinds == {"b"}:
        return torch.bool
    dtypes = {to_tensor(a[:0]).dtype for a in arrays}
    return torch.float32 if len(dtypes) != 1 else dtypes.pop()


def _torch_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "b"
    return "f" if dtype.is_floating_point or dtype.is_complex else "i"
