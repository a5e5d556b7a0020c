"""The loader state: the few numbers that say where every rank of a job stands, written and
checked in one place for :class:`~shardloader.deliver.loader.ShardLoader` and the dataset's own
``state_dict`` (:mod:`shardloader.deliver.position`).

NOTE [one state for every rank]
    The state counts global batches consumed (NOTE [resume position] in
    :mod:`shardloader.deliver.loader`), never a rank: all ranks step together, so every rank of a
    job (with a data-parallel group: every replica, and every rank of a replica) holds the same
    dict at the same step, and any one copy is every rank's.  A job of another size resumes
    from it, planning the rest for its own world.
    Under ``torch.distributed.checkpoint`` (DCP), ``dcp.save({"dataloader": loader})``
    stores the dict key by key, each value once: its planner keeps one copy of an entry that
    every rank saves under the same key (a value that is no tensor is pickled by DCP, as for
    any ``Stateful``).  ``dcp.load`` asks a fresh loader's ``state_dict()`` which keys to read,
    and fails on a key the checkpoint lacks, so the keys never depend on progress:
    ``partitions`` and ``reshapes`` are always there (``1`` and ``[]`` when nothing was
    re-split or reshaped); which readers may load a state is its ``version``, a value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardloader.errors import ResumeError
from shardloader.plan.elastic import Reshape, check_history

__all__ = ["STATE_VERSIONS", "make_state", "read_state", "resume", "state_version"]

_STATE_VERSION = 1
_RESHAPED_VERSION = 2  # a state with ``reshapes``: readers that predate them must refuse it
_PARTITIONED_VERSION = 3  # a state counted in several partitions (``partitions``), or whose
# reshapes hold a link read in several: readers that predate partitions must refuse it
STATE_VERSIONS = (_STATE_VERSION, _RESHAPED_VERSION, _PARTITIONED_VERSION)

Resume = tuple[int, int, tuple[Reshape, ...], int | None]  # epoch, position, reshapes, partitions


def state_version(reshapes: Sequence[Reshape], partitions: int) -> int:
    """The version of a state counted in ``partitions`` after the links ``reshapes``: the
    oldest whose readers load it."""
    if partitions > 1 or any(len(link) == 3 for link in reshapes):
        return _PARTITIONED_VERSION
    return _RESHAPED_VERSION if reshapes else _STATE_VERSION


def make_state(
    ds: Any, epoch: int, position: int, reshapes: Sequence[Reshape], partitions: int
) -> dict[str, Any]:
    """The state of ``ds`` after ``position`` global batches of ``epoch`` (counted in
    ``partitions``, after the links ``reshapes``): the same keys whatever the progress."""
    state: dict[str, Any] = {
        "version": state_version(reshapes, partitions),
        "epoch": int(epoch),
        "position": int(position),
        "seed": ds.seed,
        "fingerprint": ds.manifest.fingerprint,
        "plan": ds.plan_signature,
        "partitions": int(partitions),  # NOTE [node partitions] in shardloader/plan/partition.py
        "reshapes": [list(link) for link in reshapes],  # NOTE [reshape history] (plan/elastic.py)
    }
    state.update(ds.extra_state())  # a mixture's weight schedule
    return state


def read_state(ds: Any, state: Any) -> Resume:
    """``(epoch, position, reshapes, partitions)`` a saved state resumes ``ds`` at, checked
    against the dataset (same shards, seed and plan; only the batch shape may differ: the
    rest is then a new link, NOTE [reshape history] in :mod:`shardloader.plan.elastic`).
    ``partitions`` None: counted in the current ones."""
    if not isinstance(state, Mapping):
        raise ResumeError(
            f"a loader state is the dict state_dict() returned, got {type(state).__name__}"
        )
    if state.get("version") not in STATE_VERSIONS:
        raise ResumeError(
            f"loader state version {state.get('version')!r} is not one of {STATE_VERSIONS}"
        )
    reshapes = check_history(state.get("reshapes") or ())
    saved_plan = state.get("plan")
    reshaped = saved_plan != ds.plan_signature and ds.reshaped_from(str(saved_plan))
    checks = (
        ("fingerprint", ds.manifest.fingerprint, "the dataset's shards changed"),
        ("seed", ds.seed, "pass the same seed= to ShardedDataset"),
        ("plan", saved_plan if reshaped else ds.plan_signature, _plan_remedy(ds)),
    )
    for key, mine, remedy in checks:
        if state.get(key) != mine:
            raise ResumeError(
                f"saved {key} {state.get(key)!r} does not match this dataset's {mine!r}: {remedy}"
            )
    try:
        epoch, position = int(state["epoch"]), int(state["position"])
        partitions = int(state.get("partitions", 1))
    except (KeyError, TypeError, ValueError) as err:
        raise ResumeError(
            f"saved epoch {state.get('epoch')!r}, position {state.get('position')!r} and "
            f"partitions {state.get('partitions')!r} must be integers, as state_dict() "
            "writes them"
        ) from err
    if partitions < 1 or position < 0 or position % partitions:
        raise ResumeError(
            f"saved position {position} in {partitions} partition(s) is not a step "
            "boundary: state_dict() writes a multiple of the partitions"
        )
    if reshaped and (position or reshapes):  # continue with the new shape
        link = (int(reshaped), position)
        reshapes += (link if partitions == 1 else (int(reshaped), partitions, position),)
        return epoch, 0, reshapes, None
    return epoch, position, reshapes, partitions


def resume(ds: Any, state: Any) -> None:
    """Seek ``ds`` to a saved state (:func:`read_state`), replaying what it adds (a mixture's
    schedule: the main process does, a worker must not touch the shared one); plans the rest
    at once, so a history that does not fit fails here and leaves the dataset at its epoch's
    start."""
    epoch, position, reshapes, partitions = read_state(ds, state)
    # position 0 there means "the epoch has not begun"
    ds.load_extra_state(state, epoch, position if position or not reshapes else 1)
    try:
        ds.seek(epoch, position, reshapes, partitions)
        len(ds)
    except ResumeError:
        ds.seek(ds.epoch, 0)
        raise


def _plan_remedy(ds: Any) -> str:
    field = ds.elastic_option
    may = f"only {field} may change" if field else "the batch shape may not change"
    return f"use the same batch_size/planner/shuffle/uneven ({may})"
