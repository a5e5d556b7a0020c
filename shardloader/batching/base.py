"""What every batch planner shares: the protocol, the report, the one accounting rule.

A batch planner cuts the epoch's global order into global batches.

A planner is a pure function of ``(order, lengths, rng)``: the same inputs give the same batches
in every process, whatever the world size or worker count (the dataset deals batch ``i`` to rank
``i mod W``).  Planners hold only frozen options, so they pickle into workers.

NOTE [what a batch is]
    A planned batch is an int64 array in one of two shapes:

    * ``[k]``: sample ids.  The collate gets the k samples whole, in this order (an id may
      repeat only where the dataset pads a batch up).
    * ``[k, 3]``: segments ``(sample id, token start, token stop)`` of the samples' length field
      (the field whose lengths the manifest records, e.g. ``tokens``).  The dataset reads each
      sample once and hands the collate one sample per segment, in this order, with that field
      cut to ``[start:stop]`` and ``__span__ = (start, stop)``.  A sample's segments may lie in
      different batches; together they never overlap.  :class:`PackedBatches` plans these, so
      a document of any length loses no token.

    Code that needs the samples a batch reads (locating shards, working sets, padding masks)
    goes through :func:`batch_ids`; token counts go through the planner's ``report``.

NOTE [planner and collate agree without talking]
    Whatever the collate must know about the plan (padded length, truncation, the row of each
    packed segment) is re-derived in the worker from the batch alone, with the same function
    the planner used: :func:`padded_length` for bucketing and budgets,
    :func:`~shardloader.batching.fit.pack_rows` for packing; each planner lives beside its
    collate (:mod:`~shardloader.batching.padded`; :mod:`~shardloader.batching.packed` and
    :mod:`~shardloader.batching.packcollate`).  The options must match, so the dataset asks the
    planner: ``resolve_collate`` refuses a collate whose options disagree (naming both values)
    and, given none, builds one (``make_collate``) when the planner knows enough
    (``PackedBatches(pad_id=...)``).

Every planner also has a pure ``report(order, lengths, batches) -> PlanReport`` that says what
its policies dropped, truncated or split, counts every token of the epoch as delivered,
truncated or dropped, and says how many token slots (real tokens plus padding) the batches cost.

NOTE [plan signature]
    A saved loader position means the same samples only under the same plan, so the state
    carries :func:`signature_of` the planner: its class name and declared options (dataclass
    fields, or the planner's own ``signature()``), each written by :func:`stable_value`, never
    by ``repr`` (numpy 2 prints ``np.int64(4)`` where numpy 1 printed ``4``; a custom
    ``__repr__`` could print anything).  For the built-in planners the result equals their
    dataclass ``repr`` under plain Python values, so states saved before this rule still load.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardloader.batching.accounting import PlanReport, account, as_ids, segment_counts
from shardloader.errors import UsageError

__all__ = [
    "BatchPlanner",
    "PlanReport",
    "account",
    "as_ids",
    "batch_ids",
    "check_planner",
    "padded_length",
    "segment_counts",
    "signature_of",
    "stable_value",
]

OVERSIZE_POLICIES = ("error", "truncate", "drop")
LONG_DOC_POLICIES = ("split", "truncate", "drop")
TAIL_POLICIES = ("keep", "drop")
FIT_POLICIES = ("first", "best")
DEFAULT_WINDOW = 4096


class BatchPlanner(abc.ABC):
    """Cuts an epoch's order into global batches; see the module docstring.

    Everything the dataset and the plan ask of a planner is declared here, each with a default
    but :meth:`plan`; the core calls these members and never probes for others (DESIGN.md
    "How to add a planner").  Subclass it as a frozen dataclass of the planner's options.
    A class that leaves :meth:`plan` out cannot be made (a :class:`UsageError` naming it).
    """

    #: What a batch names: ``"samples"`` (ids ``[k]`` or segments ``[k, 3]``, NOTE [what a
    #: batch is]) or ``"rows"`` of the token format's streams (:class:`TokenBlocks`: the
    #: pass loads them through :mod:`shardloader.format.tokens.rows`).
    units: str = "samples"
    #: Whether :meth:`plan` needs every sample's length (the manifest's length field).
    needs_lengths: bool = False

    @property
    def elastic(self) -> str | None:
        """The one option a resume may change mid-epoch (NOTE [reshape history] in
        :mod:`shardloader.plan.elastic`), or None when the batch shape is fixed for the epoch."""
        return None

    def __new__(cls, *args: Any, **kwargs: Any) -> BatchPlanner:
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise UsageError(
                f"planner {cls.__name__} does not define {', '.join(missing)}: a BatchPlanner "
                "must define plan(order, lengths, rng) -> list of int64 batches (DESIGN.md "
                '"How to add a planner")'
            )
        return super().__new__(cls)

    # -- plan, report, signature ----------------------------------------------------------
    @abc.abstractmethod
    def plan(
        self, order: np.ndarray, lengths: np.ndarray | None, rng: np.random.Generator
    ) -> list[np.ndarray]:
        """Return global batches (int64 ids ``[k]`` or segments ``[k, 3]``); every sample of
        ``order`` is delivered exactly once (whole, or in non-overlapping pieces), except what
        a documented policy truncates or drops (see ``report``)."""

    def report(
        self, order: np.ndarray, lengths: np.ndarray | None, batches: Sequence[np.ndarray]
    ) -> PlanReport:
        """What ``batches`` deliver of ``order``, by the one accounting rule (:func:`account`):
        override only to pass the planner's padding or row shape to it."""
        return account(order, lengths, batches)

    def signature(self) -> str:
        """``Name(field=value, ...)`` of the planner's declared options (NOTE [plan
        signature]); a planner that is not a dataclass overrides it."""
        return dataclass_signature(self, "planner")

    # -- the collate it implies -----------------------------------------------------------
    def resolve_collate(self, collate_fn: Any, field: str | None) -> Any:
        """The collate the dataset uses given the user's ``collate_fn`` (maybe None) and the
        manifest's length field: build one where the plan needs it, refuse one that disagrees
        (:func:`refuse_disagreement`); by default the user's, as given."""
        return collate_fn

    def make_collate(self, *args: Any, **options: Any) -> Any:
        """A collate that agrees with this plan, for users."""
        raise UsageError(
            f"{type(self).__name__} implies no collate of its own: pass collate_fn= (or none, "
            "for the default collate)"
        )

    # -- what it reads ----------------------------------------------------------------------
    def bind(self, dataset: Any) -> np.ndarray | None:
        """Check the dataset this planner is given to, and return the lengths it plans with
        (None: the dataset loads the manifest's lengths when :attr:`needs_lengths`)."""
        return None

    def units_per_shard(self, shard_sizes: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
        """How many of the planner's :attr:`units` each shard holds (samples by default)."""
        return np.asarray(shard_sizes, np.int64)

    @property
    def batch_bytes(self) -> int | None:
        """Bytes of one planned batch when every batch has the same size (the transport then
        hands several over at once), else None."""
        return None

    # -- elastic resume -----------------------------------------------------------------------
    def segments(self, order: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
        """The segments ``[n, 3]`` a segment planner cuts ``order`` into (what an elastic
        resume removes delivered pieces from); only planners whose batches are segments."""
        raise UsageError(f"{type(self).__name__} plans whole samples, not segments")

    def plan_segments(self, segments: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        """Batches of the segments an earlier batch shape left (an elastic resume)."""
        raise UsageError(f"{type(self).__name__} plans whole samples, not segments")

    def count_rows(self, rows: int) -> int:
        """How many batches :meth:`plan` cuts ``rows`` rows into (``units == "rows"``)."""
        raise UsageError(f"{type(self).__name__} plans samples, not rows of token streams")

    def report_stream(
        self,
        shard_sizes: np.ndarray,
        lengths: np.ndarray | None,
        batches: list[np.ndarray],
        repeats: list[np.ndarray],
        scope: np.ndarray | None = None,
    ) -> dict[str, int]:
        """Where every token goes when rows ``batches`` (each once) and ``repeats`` are
        delivered (of the rows ``scope``, or all): the EpochReport fields by name (``units ==
        "rows"`` planners)."""
        raise UsageError(f"{type(self).__name__} plans samples, not rows of token streams")

    def row_slots(self, other: BatchPlanner) -> int:
        """Token slots one batch of ``other`` (an earlier shape of this planner) allocates more
        than one of this planner's (``units == "rows"`` planners; 0 otherwise)."""
        return 0

    # -- the ledger's reasons ---------------------------------------------------------------
    @property
    def truncate_to(self) -> int | None:
        """The length the planner cuts samples to, if it truncates (the ledger's reason)."""
        return None

    def explain_dropped(self, tokens: int | None) -> str | None:
        """Why the plan left out a sample of ``tokens`` tokens (None: a generic reason)."""
        return None

    def explain_truncated(self, total: int, kept: int) -> str | None:
        """Why the plan delivered ``kept`` of a sample's ``total`` tokens (None: generic)."""
        return None


def check_planner(planner: Any) -> BatchPlanner | None:
    """``planner`` as the dataset takes it: None or a :class:`BatchPlanner`, else a
    :class:`UsageError` saying what to do."""
    if planner is None or isinstance(planner, BatchPlanner):
        return planner
    raise UsageError(
        f"planner={type(planner).__name__}(...) is not a shardloader.batching.BatchPlanner: "
        "subclass it (it declares every member the dataset calls, each with a default but "
        'plan(order, lengths, rng)); see DESIGN.md "How to add a planner"'
    )


# ---------------------------------------------------------------------------------------------
# shared helpers (also used by the planners' modules)


def batch_ids(batch: np.ndarray) -> np.ndarray:
    """The samples a batch reads, in reading order: a ``[k]`` batch as it is, a ``[k, 3]``
    segment batch's sample ids each once, in the order of their first segment."""
    b = np.asarray(batch)
    if b.ndim == 1:
        return b
    ids = b[:, 0]
    _, first = np.unique(ids, return_index=True)
    return ids[np.sort(first)]


def padded_length(longest: int, pad_to_multiple_of: int = 1) -> int:
    """The length PadCollate pads a batch whose longest sample is ``longest`` to."""
    m = pad_to_multiple_of
    return -(-longest // m) * m


def stable_value(value: Any) -> str:
    """One option value as signature text, the same in every Python and numpy version: numpy
    scalars as the Python number they hold, tuples and lists element by element."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)  # stable for these types (float: shortest round-trip, since 3.1)
    if isinstance(value, list):
        return "[" + ", ".join(stable_value(v) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(stable_value(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return signature_of(value)
    raise UsageError(
        f"option value {value!r} ({type(value).__name__}) has no stable signature text: "
        "options must be numbers, strings, booleans, None or tuples of them"
    )


def signature_of(options: Any) -> str:
    """``Name(field=value, ...)`` of a frozen options object; see NOTE [plan signature].

    A planner gives its own (:meth:`BatchPlanner.signature`); a dataclass its class name and
    its ``repr=True`` fields; anything else has no signature (a :class:`UsageError`).
    """
    if isinstance(options, BatchPlanner):
        text = options.signature()
        if not isinstance(text, str):
            raise UsageError(
                f"{type(options).__name__}.signature() returned {type(text).__name__}, not str"
            )
        return text
    return dataclass_signature(options, "options")


def dataclass_signature(options: Any, what: str) -> str:
    """``Name(field=value, ...)`` of a dataclass's ``repr=True`` fields."""
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        fields = ", ".join(
            f"{f.name}={stable_value(getattr(options, f.name))}"
            for f in dataclasses.fields(options)
            if f.repr
        )
        return f"{type(options).__name__}({fields})"
    raise UsageError(
        f"{what} {type(options).__name__} has no signature, which a saved loader position "
        "needs to check it resumes the same plan: make it a frozen dataclass of its options, "
        "or give it a signature() method returning a str of them"
    )


def check_positive(name: str, value: int | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")


def check_pad_id(value: Any, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise UsageError(f"pad_id must be the tokenizer's integer pad id, got {value!r}")


def check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise UsageError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def lengths_of(planner: str, ids: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """Lengths of ``ids`` (indexed by global id), with a clear error when they are missing."""
    if lengths is None:
        raise UsageError(
            f"{planner} needs per-sample lengths: re-pack with a length field (--tokenizer "
            "tokenizer.json for text, --token-field input_ids for records that hold token ids; "
            "both record token counts in the manifest) or use FixedBatches"
        )
    lens = np.asarray(lengths)
    if lens.ndim != 1 or (lens.size and lens.dtype.kind not in "iu"):
        raise UsageError(f"lengths must be a 1-D integer array, got {lens.dtype}{lens.shape}")
    if ids.size and (ids.max() >= lens.size or ids.min() < 0):
        raise UsageError(
            f"sample id {int(ids.max())} is outside lengths (size {lens.size}); lengths must be "
            "indexed by global sample id"
        )
    if lens.size and lens.min() < 0:
        raise UsageError(f"lengths contains a negative length ({int(lens.min())})")
    return lens[ids].astype(np.int64, copy=False)


def shuffled(batches: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    return [batches[i] for i in rng.permutation(len(batches))]


def refuse_disagreement(collate: Any, planner: Any, pairs: Sequence[tuple[str, Any, Any]]) -> None:
    """Raise naming every option where ``collate`` and ``planner`` differ."""
    diffs = [(name, mine, theirs) for name, mine, theirs in pairs if mine != theirs]
    if not diffs:
        return
    what = "; ".join(
        f"{type(collate).__name__} {name}={theirs!r}, {type(planner).__name__} {name}={mine!r}"
        for name, mine, theirs in diffs
    )
    raise UsageError(
        f"collate_fn disagrees with the planner ({what}): the batches would not have the "
        "planned shape or tokens; build the collate with planner.make_collate(...) or leave "
        "collate_fn out where the planner can build it"
    )
