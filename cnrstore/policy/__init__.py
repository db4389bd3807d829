"""Policies over the engine: which bit width to quantize with (and, in their own modules, when to
write baselines and which rows to write)."""

from cnrstore.policy.bitwidth import BitWidthPolicy
from cnrstore.policy.compaction import (
    CompactionPolicy,
    EveryN,
    History,
    IntermittentRule,
    KeepEveryNSteps,
    KeepLast,
    KeepVersions,
    MaxChain,
    Plan,
    Retention,
)
from cnrstore.policy.interval import CheckpointInterval, Overhead

__all__ = [
    "BitWidthPolicy", "CompactionPolicy", "IntermittentRule", "MaxChain", "EveryN", "Retention", "KeepLast",
    "KeepEveryNSteps", "KeepVersions", "History", "Plan",
    "CheckpointInterval", "Overhead",
]
