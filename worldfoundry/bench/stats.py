"""Paired-timing statistics and verdicts."""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import stats

VERDICTS = (
    "recommended",
    "measured_quality_tradeoff",
    "no_stable_gain",
    "quality_only",
    "invalid_not_executed",
    "invalid_nonfinite",
    "invalid_timing_mismatch",
    "invalid_timing",
    "noisy_host",
    "invalid_exactness_claim",
    "refused_shared_gpu",
    "rejected_at_install",
)


def bootstrap_ci(ratios: list[float], *, confidence: float = 0.95, resamples: int = 4000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap CI of the median of per-round speedups (``scipy.stats.bootstrap``)."""
    data = np.asarray(ratios, dtype=np.float64)
    if data.size == 0:
        return (float("nan"), float("nan"))
    if data.size == 1 or np.all(data == data[0]):
        return (float(data[0]), float(data[0]))
    res = stats.bootstrap((data,), np.median, confidence_level=confidence, n_resamples=resamples,
                          method="percentile", random_state=np.random.default_rng(seed))
    return (float(res.confidence_interval.low), float(res.confidence_interval.high))


def summarize_speed(dense_s: list[float], cand_s: list[float]) -> dict[str, Any]:
    ratios = [d / c for d, c in zip(dense_s, cand_s)]
    low, high = bootstrap_ci(ratios)
    return {
        "dense_s": dense_s,
        "candidate_s": cand_s,
        "speedups": ratios,
        "median_speedup": float(np.median(ratios)),
        "ci95": [low, high],
        "dense_median_s": float(np.median(dense_s)),
        "candidate_median_s": float(np.median(cand_s)),
    }


def decide(*, installed: bool, finite: bool, executed: bool, exact_ok: bool, timing_ok: bool,
           quality_ok: bool, speed: dict[str, Any] | None, gpu_shared: bool, noise_floor: float = 1.0,
           bound_ok: bool = True, noisy: bool = False) -> str:
    """The verdict, invalid states first. ``recommended`` needs the speedup CI's lower bound above both 1 and
    ``noise_floor`` (the upper CI bound of dense-vs-dense control pairs measured in the same run).

    ``bound_ok=False`` (a speedup above what the receipts allow) gives ``invalid_timing``; ``noisy=True`` (the
    noise floor above the threshold) gives ``noisy_host`` instead of any speed verdict."""
    if not installed:
        return "rejected_at_install"
    if not finite:
        return "invalid_nonfinite"
    if not executed:
        return "invalid_not_executed"
    if not exact_ok:
        return "invalid_exactness_claim"
    if speed is None:
        return "quality_only"
    if not timing_ok:
        return "invalid_timing_mismatch"
    if not bound_ok:
        return "invalid_timing"
    if gpu_shared:
        return "refused_shared_gpu"
    if not quality_ok:
        return "measured_quality_tradeoff"
    if noisy:
        return "noisy_host"
    return "recommended" if speed["ci95"][0] > max(1.0, noise_floor) else "no_stable_gain"
