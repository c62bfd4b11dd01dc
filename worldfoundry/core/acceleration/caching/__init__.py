"""Step-caching numerics shared by cache plugins: the EasyCache transformation cache and conditioning snapshots."""

from __future__ import annotations

from worldfoundry.core.acceleration.caching.condition_snapshot import ConditionSnapshot
from worldfoundry.core.acceleration.caching.transformation_cache import (
    DenseGate,
    TransformationCache,
    dense_gate,
    mean_abs,
    mean_abs_diff,
)

__all__ = [
    "ConditionSnapshot",
    "DenseGate",
    "TransformationCache",
    "dense_gate",
    "mean_abs",
    "mean_abs_diff",
]
