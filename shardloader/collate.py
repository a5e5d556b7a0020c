"""Collate functions: a list of sample dicts in, one batch dict of tensors out (in the worker).

Rules shared by every collate here (``default_collate`` semantics, made explicit):

* numbers stack into a 1-D tensor: Python int → int64, float → float64, bool → bool; numpy
  scalars and 0-d tensors keep their dtype (as ``torch.utils.data.default_collate``);
* tensors and numpy arrays of equal shape stack; lists/tuples of numbers count as 1-D arrays;
* strings, bytes, ``None`` and anything else stay a Python list; dicts recurse (a nested
  field is named by its dotted path, e.g. ``"meta.ids"``);
* a field whose arrays differ in shape is padded only when it has an explicit pad value.

NOTE [pad values are explicit]
    Every variable-length field needs an explicit pad value: a missing one is a
    :class:`~shardloader.errors.UsageError` that names the field and the remedy, never a silent
    ``0``.  That covers integer token fields (``0`` is often a real token id) and also float
    sequences: one rule is easier to remember than a dtype-dependent default, and a float
    feature padded with ``0.0`` is just as wrong when the model ignores the mask.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from shardloader.batching import LONG_DOC_POLICIES, pack_rows
from shardloader.errors import UsageError

__all__ = ["PadCollate", "DetectionCollate", "PackCollate", "collate_samples", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # label value torch's cross_entropy ignores by default
PADDING_SIDES = ("right", "left")
DETECTION_MODES = ("concat", "pad")


# ---------------------------------------------------------------------------------------------
# default semantics


def _is_number(v: Any) -> bool:
    return isinstance(v, (numbers.Number, np.generic)) and not isinstance(v, (str, bytes))


def _is_array(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray))


def _is_number_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_is_number(x) for x in v)


def _to_tensor(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, np.ndarray):
        if not v.flags.writeable:  # e.g. np.frombuffer over read bytes: torch would warn
            return torch.from_numpy(v.copy())
        return torch.from_numpy(np.ascontiguousarray(v))
    return torch.as_tensor(v)


def _stack_numbers(values: Sequence[Any]) -> torch.Tensor:
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack(list(values))  # 0-d tensors
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return torch.tensor([bool(v) for v in values])
    if all(isinstance(v, np.generic) for v in values):
        return torch.as_tensor(np.asarray(values))  # numpy scalars keep their dtype
    if all(isinstance(v, (int, np.integer)) for v in values):
        return torch.as_tensor(np.asarray(values), dtype=torch.int64)
    return torch.as_tensor(np.asarray(values, dtype=np.float64))


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(v.shape) if _is_array(v) else (len(v),)


def collate_samples(
    samples: Sequence[Mapping[str, Any]],
    *,
    pad: Mapping[str, Any] | None = None,
    ragged: str = "error",
    _prefix: str = "",
) -> dict[str, Any]:
    """Collate sample dicts with the module's default rules.

    ``pad`` maps a dotted field name to a function ``(name, values) -> value`` that collates
    that field instead (PadCollate passes its padder).  ``ragged`` says what happens to arrays
    of unequal shapes without one: ``"error"`` or ``"list"`` (keep them as a list).
    """
    if not samples:
        raise UsageError("cannot collate an empty batch")
    if ragged not in ("error", "list"):
        raise UsageError(f"ragged={ragged!r} is not 'error' or 'list'")
    keys = list(samples[0].keys())
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping):
            raise UsageError(f"sample {i} is a {type(s).__name__}, not a dict; collate dicts")
        if s.keys() != samples[0].keys():
            diff = sorted(set(s.keys()) ^ set(keys))
            raise UsageError(
                f"sample {i} has different fields from sample 0 ({', '.join(map(repr, diff))}); "
                "every sample of a batch needs the same fields"
            )
    out: dict[str, Any] = {}
    for key in keys:
        name = f"{_prefix}{key}"
        values = [s[key] for s in samples]
        if pad is not None and name in pad:
            out[key] = pad[name](name, values)
        else:
            out[key] = _collate_field(name, values, pad, ragged)
    return out


def _collate_field(name: str, values: list[Any], pad: Mapping[str, Any] | None, ragged: str) -> Any:
    first = values[0]
    if isinstance(first, Mapping):
        return collate_samples(values, pad=pad, ragged=ragged, _prefix=f"{name}.")
    if all(_is_number(v) or (isinstance(v, torch.Tensor) and v.ndim == 0) for v in values):
        return _stack_numbers(values)
    if all(_is_array(v) or _is_number_list(v) for v in values) and not all(
        isinstance(v, (list, tuple)) and not v for v in values
    ):
        shapes = {_shape(v) for v in values}
        if len(shapes) == 1:
            # torch's default_collate stacks straight into shared memory inside a DataLoader
            # worker, saving a copy of every image batch on its way to the main process
            return default_collate([_to_tensor(v) for v in values])
        if ragged == "list":
            return list(values)
        raise UsageError(_ragged_message(name, values))
    return list(values)


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


def _as_array(name: str, v: Any) -> np.ndarray | torch.Tensor:
    if _is_array(v):
        if v.ndim == 0:
            raise UsageError(f"field {name!r} has a scalar where a sequence is padded")
        return v
    if _is_number_list(v):
        return np.asarray(v)
    raise UsageError(f"field {name!r}: cannot pad a {type(v).__name__}; give arrays or lists")


def _result_dtype(name: str, arrays: Sequence[Any], pad_value: Any) -> torch.dtype:
    """int64 for integer data (token ids, labels with -100), the input dtype otherwise."""
    arrays = [a for a in arrays if a.shape[0]] or list(arrays)  # [] has no meaningful dtype
    kinds = {a.dtype.kind if isinstance(a, np.ndarray) else _torch_kind(a.dtype) for a in arrays}
    if kinds <= {"i", "u"}:
        if not float(pad_value).is_integer():
            raise UsageError(f"field {name!r} holds integers but its pad value is {pad_value!r}")
        return torch.int64
    if kinds == {"b"}:
        return torch.bool
    dtypes = {_to_tensor(a[:0]).dtype for a in arrays}
    return torch.float32 if len(dtypes) != 1 else dtypes.pop()


def _torch_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "b"
    return "f" if dtype.is_floating_point or dtype.is_complex else "i"


# ---------------------------------------------------------------------------------------------
# dynamic padding


@dataclass(frozen=True)
class PadCollate:
    """Pads each variable-length field to the batch's longest, and emits masks.

    ``pad_values`` maps a field (dotted path for nested dicts) to its pad value, e.g.
    ``{"input_ids": tokenizer.token_to_id("<pad>"), "labels": -100}``; those fields are always
    padded (along the first dimension; trailing dimensions must match), the rest follow the
    module's default rules.  Padded length = longest in the batch (after truncation to
    ``max_length``), rounded up to ``pad_to_multiple_of``.  ``padding_side`` and
    ``truncation_side`` are ``"right"`` or ``"left"``.  Integer fields come out as int64.

    ``attention_mask`` (int64, 1 = real) and ``lengths`` (int64, after truncation) describe
    ``mask_field`` (default: the first key of ``pad_values`` present in the batch).
    """

    pad_values: Mapping[str, int | float | bool] = field(default_factory=dict)
    pad_to_multiple_of: int = 1
    max_length: int | None = None
    padding_side: str = "right"
    truncation_side: str = "right"
    mask_field: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pad_values", dict(self.pad_values))
        m = self.pad_to_multiple_of
        if not isinstance(m, int) or m < 1:
            raise UsageError(f"pad_to_multiple_of must be a positive integer, got {m!r}")
        if self.max_length is not None:
            if not isinstance(self.max_length, int) or self.max_length < 1:
                raise UsageError(f"max_length must be a positive integer, got {self.max_length!r}")
            if self.max_length % m:
                raise UsageError(
                    f"max_length={self.max_length} is not a multiple of pad_to_multiple_of={m}"
                )
        for name in ("padding_side", "truncation_side"):
            if getattr(self, name) not in PADDING_SIDES:
                raise UsageError(f"{name}={getattr(self, name)!r} is not 'right' or 'left'")
        for key, value in self.pad_values.items():
            if not _is_number(value):
                raise UsageError(f"pad value of {key!r} must be a number, got {value!r}")
        if self.mask_field is not None and self.mask_field not in self.pad_values:
            raise UsageError(f"mask_field {self.mask_field!r} has no entry in pad_values")

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        lengths: dict[str, torch.Tensor] = {}
        padders = {name: _Padder(self, lengths) for name in self.pad_values}
        out = collate_samples(samples, pad=padders)
        mask_field = self.mask_field or next((k for k in self.pad_values if k in lengths), None)
        if mask_field is not None and mask_field in lengths:
            for key in ("attention_mask", "lengths"):
                if key in out:
                    raise UsageError(
                        f"samples already have a field {key!r}, which PadCollate emits; rename it"
                    )
            lens = lengths[mask_field]
            width = _get(out, mask_field).shape[1]
            pos = torch.arange(width)
            if self.padding_side == "right":
                mask = pos[None, :] < lens[:, None]
            else:
                mask = pos[None, :] >= (width - lens)[:, None]
            out["attention_mask"] = mask.to(torch.int64)
            out["lengths"] = lens
        return out

    def pad(self, name: str, values: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad one field's values; returns (padded [B, T, ...], lengths [B])."""
        arrays = [_as_array(name, v) for v in values]
        trailing = {tuple(a.shape[1:]) for a in arrays}
        if len(trailing) != 1:
            raise UsageError(
                f"field {name!r}: padding is along the first dimension, but the other "
                f"dimensions differ ({sorted(trailing)})"
            )
        value = self.pad_values[name]
        dtype = _result_dtype(name, arrays, value)
        lens = [int(a.shape[0]) for a in arrays]
        if self.max_length is not None:
            keep = self.max_length
            if self.truncation_side == "right":
                arrays = [a[:keep] for a in arrays]
            else:
                arrays = [a[max(len(a) - keep, 0) :] for a in arrays]
            lens = [min(n, keep) for n in lens]
        m = self.pad_to_multiple_of
        width = -(-max(lens) // m) * m
        shape = (len(arrays), width, *trailing.pop())
        right = self.padding_side == "right"
        if not any(isinstance(a, torch.Tensor) for a in arrays):
            # numpy fills and casts (uint16 → int64) far cheaper than torch indexing
            np_out = np.full(shape, value, dtype=torch.empty(0, dtype=dtype).numpy().dtype)
            for i, (a, n) in enumerate(zip(arrays, lens, strict=True)):
                if n:
                    if right:
                        np_out[i, :n] = a
                    else:
                        np_out[i, width - n :] = a
            return torch.from_numpy(np_out), torch.tensor(lens, dtype=torch.int64)
        out = torch.full(shape, value, dtype=dtype)
        for i, (a, n) in enumerate(zip(arrays, lens, strict=True)):
            if n:
                t = _to_tensor(np.asarray(a, dtype=np.int64) if dtype == torch.int64 else a)
                if right:
                    out[i, :n] = t
                else:
                    out[i, width - n :] = t
        return out, torch.tensor(lens, dtype=torch.int64)


@dataclass(frozen=True)
class _Padder:
    """Picklable per-call adapter: pads a field and records its lengths."""

    collate: PadCollate
    lengths: dict[str, torch.Tensor]

    def __call__(self, name: str, values: Sequence[Any]) -> torch.Tensor:
        padded, lens = self.collate.pad(name, values)
        self.lengths[name] = lens
        return padded


def _get(out: Mapping[str, Any], dotted: str) -> Any:
    value: Any = out
    for part in dotted.split("."):
        value = value[part]
    return value


# ---------------------------------------------------------------------------------------------
# detection: a variable number of items per sample


@dataclass(frozen=True)
class DetectionCollate:
    """Collate for samples with a variable number of items (boxes, their labels, masks).

    ``item_fields`` hold one row per item (e.g. ``boxes`` [N, 4], ``labels`` [N]); every item
    field of a sample must have the same N.  ``mode="concat"`` (default) concatenates them to
    [sum N, ...] and adds ``batch_index`` (int64 [sum N], the sample each item belongs to);
    ``mode="pad"`` pads them to [B, max N, ...] with the explicit ``pad_values`` and adds
    ``num_items`` (int64 [B]).  Other fields follow the default rules, except that arrays of
    unequal shapes (images of different sizes) stay a list instead of raising.
    """

    item_fields: Collection[str] = ("boxes", "labels")
    mode: str = "concat"
    pad_values: Mapping[str, int | float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "item_fields", tuple(self.item_fields))
        object.__setattr__(self, "pad_values", dict(self.pad_values))
        if self.mode not in DETECTION_MODES:
            raise UsageError(f"mode={self.mode!r} is not one of {DETECTION_MODES}")
        if self.mode == "pad":
            missing = [f for f in self.item_fields if f not in self.pad_values]
            if missing:
                raise UsageError(
                    f"DetectionCollate(mode='pad') needs a pad value for {', '.join(missing)}: "
                    "pass pad_values={...} (e.g. 0.0 for boxes, -1 for labels), or use "
                    "mode='concat'"
                )

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise UsageError("cannot collate an empty batch")
        present = [f for f in self.item_fields if samples and f in samples[0]]
        rest = [{k: v for k, v in s.items() if k not in present} for s in samples]
        out = collate_samples(rest, ragged="list") if rest and rest[0] else {}
        counts = self._counts(present, samples)
        extra = "batch_index" if self.mode == "concat" else "num_items"
        if extra in out:
            raise UsageError(f"samples already have a field {extra!r}; rename it")
        for name in present:
            arrays = [_to_tensor(_as_array(name, s[name])) for s in samples]
            if self.mode == "concat":
                out[name] = torch.cat(arrays)
            else:
                out[name] = PadCollate({name: self.pad_values[name]}).pad(name, arrays)[0]
        if present:
            n = torch.tensor(counts, dtype=torch.int64)
            if self.mode == "concat":
                out[extra] = torch.repeat_interleave(torch.arange(len(samples)), n)
            else:
                out[extra] = n
        return out

    @staticmethod
    def _counts(present: Sequence[str], samples: Sequence[Mapping[str, Any]]) -> list[int]:
        counts: list[int] = []
        for i, s in enumerate(samples):
            ns = {f: len(s[f]) for f in present}
            if len(set(ns.values())) > 1:
                raise UsageError(
                    f"sample {i} has different item counts per field ({ns}); every item field "
                    "needs one row per item"
                )
            counts.append(next(iter(ns.values()), 0))
        return counts


# ---------------------------------------------------------------------------------------------
# sequence packing


@dataclass(frozen=True)
class PackCollate:
    """Packs a batch of token documents (or segments of them) into rows of ``seq_len`` tokens.

    The items (field ``field`` of each sample, or bare arrays) are placed in batch order by
    :func:`shardloader.batching.pack_rows`, the rule :class:`~shardloader.batching.PackedBatches`
    planned with, so a planned batch of segments fills exactly its planned rows.  Build it with
    ``PackedBatches.make_collate`` (or let the dataset do it): the dataset refuses a PackCollate
    whose ``seq_len``, ``rows_per_batch``, ``long_docs`` or ``field`` disagree with the plan.
    Used on its own with whole documents, ``long_docs`` says what happens to one longer than
    ``seq_len``: ``"split"`` cuts it into pieces over several rows, ``"truncate"`` keeps its
    first ``seq_len`` tokens, ``"drop"`` treats it as an error.  Nothing is cut silently: items
    that need more than ``rows_per_batch`` rows are an error.

    Output (R rows; R = ``rows_per_batch`` when set, padding with empty rows, else as many as
    needed):

    * ``input_ids`` int64 [R, seq_len], ``pad_id`` after each row's segments;
    * ``labels`` int64 [R, seq_len]: the input ids, *unshifted* (the model shifts, as Hugging
      Face causal LMs do: logits at t are scored against ``labels[t + 1]``), with ``-100`` at
      padding and at the first token of every segment (document or piece), so no position
      learns to predict across a document boundary;
    * ``position_ids`` int64 [R, seq_len]: 0, 1, ... restarting at every segment, and at the
      start of each row's padding run;
    * ``attention_mask`` int64 [R, seq_len]: 1 for real tokens, 0 for padding (documents are
      kept apart by ``cu_seqlens``/``position_ids``, not by this mask);
    * ``cu_seqlens`` int32 [segments + 1]: segment boundaries in the flattened
      ``input_ids.view(-1)`` (flash-attn varlen format); each row's padding run is a segment of
      its own, so ``cu_seqlens[-1] == R * seq_len``; ``max_seqlen``: int, longest segment;
    * other sample fields as per-item lists in batch order (e.g. ``__key__``, and
      ``__span__`` = (start, stop) of each segment the dataset cut).
    """

    seq_len: int
    pad_id: int
    field: str = "tokens"
    rows_per_batch: int | None = None
    long_docs: str = "split"

    def __post_init__(self) -> None:
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise UsageError(f"seq_len must be a positive integer, got {self.seq_len!r}")
        if not isinstance(self.pad_id, (int, np.integer)) or isinstance(self.pad_id, bool):
            raise UsageError(f"pad_id must be the tokenizer's integer pad id, got {self.pad_id!r}")
        if self.rows_per_batch is not None and self.rows_per_batch < 1:
            raise UsageError(f"rows_per_batch must be positive, got {self.rows_per_batch!r}")
        if self.long_docs not in LONG_DOC_POLICIES:
            raise UsageError(f"long_docs={self.long_docs!r} is not one of {LONG_DOC_POLICIES}")

    def _documents(self, samples: Sequence[Any]) -> tuple[list[np.ndarray], dict[str, list]]:
        docs: list[np.ndarray] = []
        rest: dict[str, list] = {}
        for i, s in enumerate(samples):
            value = s
            if isinstance(s, Mapping):
                if self.field not in s:
                    raise UsageError(
                        f"sample {i} has no field {self.field!r} (fields: {', '.join(s)}); pass "
                        "PackCollate(field=...) naming the token field"
                    )
                value = s[self.field]
                for k, v in s.items():
                    if k != self.field:
                        rest.setdefault(k, []).append(v)
            a = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                raise UsageError(
                    f"sample {i}: {self.field!r} must be a 1-D integer token array, "
                    f"got {a.dtype}{a.shape}"
                )
            docs.append(a)
        return docs, rest

    def __call__(self, samples: Sequence[Any]) -> dict[str, Any]:
        docs, rest = self._documents(samples)
        if self.long_docs == "drop":
            long = [i for i, d in enumerate(docs) if d.size > self.seq_len]
            if long:
                raise UsageError(
                    f"document {long[0]} of the batch has {docs[long[0]].size} tokens > "
                    f"seq_len={self.seq_len}, but long_docs='drop' means the planner should "
                    "have dropped it; build the collate with PackedBatches.make_collate()"
                )
        if self.long_docs == "truncate":
            docs = [d[: self.seq_len] for d in docs]
        rows = pack_rows([d.size for d in docs], self.seq_len)
        n_rows = len(rows)
        if self.rows_per_batch is not None:
            if n_rows > self.rows_per_batch:
                raise UsageError(
                    f"the batch's documents need {n_rows} rows of {self.seq_len} tokens, more "
                    f"than rows_per_batch={self.rows_per_batch}: plan the batches with "
                    "PackedBatches (it cuts long documents into segments that fit), and build "
                    "this collate with PackedBatches.make_collate()"
                )
            n_rows = self.rows_per_batch
        s = self.seq_len
        ids = np.full((n_rows, s), self.pad_id, np.int64)
        labels = np.full((n_rows, s), IGNORE_INDEX, np.int64)
        pos = np.zeros((n_rows, s), np.int64)
        mask = np.zeros((n_rows, s), np.int64)
        bounds = [0]
        for r in range(n_rows):
            col = 0
            for doc, start, stop in rows[r] if r < len(rows) else ():
                n = stop - start
                if not n:
                    continue
                ids[r, col : col + n] = docs[doc][start:stop]
                labels[r, col + 1 : col + n] = ids[r, col + 1 : col + n]
                pos[r, col : col + n] = np.arange(n)
                mask[r, col : col + n] = 1
                col += n
                bounds.append(r * s + col)
            if col < s:
                pos[r, col:] = np.arange(s - col)
                bounds.append((r + 1) * s)
        cu = np.asarray(bounds, np.int32)
        out: dict[str, Any] = dict(rest)
        out.update(
            input_ids=torch.from_numpy(ids),
            labels=torch.from_numpy(labels),
            position_ids=torch.from_numpy(pos),
            attention_mask=torch.from_numpy(mask),
            cu_seqlens=torch.from_numpy(cu),
            max_seqlen=int(np.diff(cu).max()) if cu.size > 1 else 0,
        )
        return out
