"""The collates under their historical import path; each lives next to its planner.

``from shardloader.collate import PadCollate`` keeps working.  The homes:
:class:`PadCollate` in :mod:`shardloader.batching.padded`, :class:`PackCollate` (and
``IGNORE_INDEX``) in :mod:`shardloader.batching.packcollate`, :func:`collate_samples` (the default
rules) in :mod:`shardloader.batching.default`, :class:`RawCollate` in
:mod:`shardloader.batching.raw`, :class:`DetectionCollate` in :mod:`shardloader.vision.collate`.
This module only re-exports.
"""

from shardloader.batching.default import collate_samples
from shardloader.batching.packcollate import IGNORE_INDEX, PackCollate
from shardloader.batching.padded import PadCollate
from shardloader.batching.raw import RawCollate
from shardloader.vision.collate import DetectionCollate

__all__ = [
    "PadCollate",
    "DetectionCollate",
    "PackCollate",
    "RawCollate",
    "collate_samples",
    "IGNORE_INDEX",
]
