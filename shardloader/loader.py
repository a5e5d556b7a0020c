"""``make_loader``: a plain torch DataLoader that also saves and restores its position.

NOTE [resume position]: a rank's ``j``-th batch is global batch ``start + j*W + rank``, and all
ranks step in lockstep, so after ``k`` batches the first ``start + k*W`` global batches are
consumed on every rank.  That single number (with epoch, seed and the manifest fingerprint) is
the whole state; a resumed loader plans the remaining batches for *its* world size and worker
count and seeks straight to them, reading nothing it skips.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from shardloader.dataset import _EPOCH, _START, ShardedDataset
from shardloader.errors import ResumeError, UsageError

__all__ = ["ShardLoader", "make_loader"]

_STATE_VERSION = 1


class ShardLoader(DataLoader):  # type: ignore[type-arg]
    """A ``torch.utils.data.DataLoader`` over a :class:`ShardedDataset` with resumable state."""

    def __init__(self, dataset: ShardedDataset, **kwargs: Any) -> None:
        if not isinstance(dataset, ShardedDataset):
            raise UsageError("ShardLoader needs a ShardedDataset")
        for banned in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if banned in kwargs:
                raise UsageError(
                    f"{banned}= belongs to ShardedDataset (batches are formed in the workers), "
                    "not to the loader"
                )
        if kwargs.get("num_workers", 0) > 0:
            kwargs.setdefault("persistent_workers", True)
            kwargs.setdefault("prefetch_factor", 4)
        kwargs.setdefault("collate_fn", _already_collated)
        super().__init__(dataset, batch_size=None, **kwargs)
        self._position = 0  # global batches consumed in the current epoch
        self._epoch = dataset.epoch

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        ds.refresh_world()
        state = ds._control.get()
        self._epoch, start, world = state[_EPOCH], state[_START], ds.world_size
        self._position = start
        for batch in super().__iter__():
            self._position += world
            yield batch
        if ds.epoch == self._epoch:
            ds._control.set(_START, 0)  # the epoch is done; a re-run starts it afresh
        self._position = 0

    def state_dict(self) -> dict[str, Any]:
        """A few numbers: enough to continue exactly where every rank stands now."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "seed": ds.seed,
            "fingerprint": ds.manifest.fingerprint,
            "plan": ds.plan_signature,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run; world size and num_workers may differ from the saving run."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        if state.get("version") != _STATE_VERSION:
            raise ResumeError(
                f"loader state version {state.get('version')!r} is not {_STATE_VERSION}"
            )
        checks = (
            ("fingerprint", ds.manifest.fingerprint, "the dataset's shards changed"),
            ("seed", ds.seed, "pass the same seed= to ShardedDataset"),
            ("plan", ds.plan_signature, "use the same batch_size/planner/shuffle/uneven"),
        )
        for key, mine, remedy in checks:
            if state.get(key) != mine:
                raise ResumeError(
                    f"saved {key} {state.get(key)!r} does not match this dataset's {mine!r}: "
                    f"{remedy}"
                )
        ds.seek(int(state["epoch"]), int(state["position"]))
        self._epoch, self._position = int(state["epoch"]), int(state["position"])


def _already_collated(batch: Any) -> Any:
    """Batches are collated in the workers; torch's per-item ``default_convert`` is skipped."""
    return batch


def make_loader(dataset: ShardedDataset, **kwargs: Any) -> ShardLoader:
    """A configured DataLoader: workers persist across epochs, batches come formed."""
    return ShardLoader(dataset, **kwargs)
