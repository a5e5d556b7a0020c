"""Seeding the generators a pass draws from: torch's and the global ones, in the workers.

The seeds themselves are pure numbers of :mod:`shardloader.plan.shuffle` (derived from the
dataset's seed, the epoch and the batch); only here do they touch torch or global state.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np

from shardloader.plan.shuffle import TRANSFORMS, derive_seed

if TYPE_CHECKING:  # torch is imported where a generator is made, not by every importer
    import torch

__all__ = ["batch_generator", "generator_of", "seed_global_rngs"]


def batch_generator(seed: int, epoch: int, batch: int) -> torch.Generator:
    """The torch generator shardloader's own transforms draw from for global batch ``batch``
    (NOTE [transform generators] in :mod:`shardloader.vision.transforms`): a stream of its own,
    apart from the global generators that :func:`seed_global_rngs` seeds for user transforms."""
    return generator_of(derive_seed(seed, epoch, batch, TRANSFORMS))


def generator_of(seed: int) -> torch.Generator:
    """A ``torch.Generator`` seeded with ``seed`` (one of :func:`transform_seeds`)."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(int(seed))
    return generator


def seed_global_rngs(seed: int) -> None:
    """Seed torch, numpy and ``random`` for user transforms that use the global generators."""
    import torch

    # The CPU generator only: torch.manual_seed also seeds (and lazily initialises) every
    # accelerator backend, which costs milliseconds per call; transforms in workers run on CPU.
    torch.random.default_generator.manual_seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)
