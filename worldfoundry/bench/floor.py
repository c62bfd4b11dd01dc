"""The step-floor speedup: per-step minimum times over rounds, summed, dense over candidate.

Interference on a benchmark host (another process on a core, a slower phase of a shared machine, a collector or
page-fault burst) only ever *adds* time, and it comes in bursts shorter than a generation: a slow phase covers a
few steps of one request, then passes. So the fastest time a step index reached over the rounds is the best
estimate of what that step costs without interference, and it converges as rounds are added, where a median of
per-request ratios keeps every burst that happened to straddle one side of a pair.

For each seed (the *group*: a cache skips the same steps for the same seed, so step ``i`` of seed ``s`` is the same
work in every round) and each side, the time of step ``i`` is its minimum over that seed's rounds; a side's floor is
the sum over steps, summed over seeds; the speedup is dense floor / candidate floor.

Its 95 % CI is a paired, seed-stratified percentile bootstrap: the rounds of each seed are resampled with
replacement (the same rounds for both sides), and the floor ratio is recomputed. A seed timed only once has no
spread to resample, so the CI is undefined (``nan``) until every seed has two rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: Bootstrap resamples of the step-floor CI.
RESAMPLES = 2000


def _grouped(dense: Sequence[Sequence[float]], cand: Sequence[Sequence[float]],
             groups: Sequence[Any]) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Per group, the ``(rounds, steps)`` matrices of both sides; ``None`` when the step lists do not line up."""
    if not (len(dense) == len(cand) == len(groups)) or not dense:
        return None
    out = []
    for g in dict.fromkeys(groups):
        rows = [i for i, x in enumerate(groups) if x == g]
        d = [list(dense[i]) for i in rows]
        c = [list(cand[i]) for i in rows]
        lengths = {len(x) for x in d} | {len(x) for x in c}
        if len(lengths) != 1 or 0 in lengths:
            return None
        out.append((np.asarray(d, dtype=np.float64), np.asarray(c, dtype=np.float64)))
    return out


def step_floor(dense: Sequence[Sequence[float]], cand: Sequence[Sequence[float]],
               groups: Sequence[Any]) -> dict[str, Any] | None:
    """The step-floor speedup with its CI, or ``None`` when the per-step times do not line up (missing steps, or
    rounds of one seed with different step counts).

    Args:
        dense, cand: per round, the step times (seconds) of each side.
        groups: per round, its seed.

    Returns:
        ``{"speedup", "ci95", "dense_floor_s", "candidate_floor_s"}``.
    """
    parts = _grouped(dense, cand, groups)
    if parts is None:
        return None
    d_floor = sum(float(d.min(axis=0).sum()) for d, _ in parts)
    c_floor = sum(float(c.min(axis=0).sum()) for _, c in parts)
    if not (c_floor > 0 and d_floor > 0):
        return None
    return {"speedup": d_floor / c_floor, "ci95": list(_bootstrap(parts)), "dense_floor_s": d_floor,
            "candidate_floor_s": c_floor}


def _bootstrap(parts: list[tuple[np.ndarray, np.ndarray]], seed: int = 0) -> tuple[float, float]:
    if any(d.shape[0] < 2 for d, _ in parts):
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    d_tot = np.zeros(RESAMPLES)
    c_tot = np.zeros(RESAMPLES)
    for d, c in parts:
        idx = rng.integers(0, d.shape[0], size=(RESAMPLES, d.shape[0]))
        d_tot += d[idx].min(axis=1).sum(axis=1)
        c_tot += c[idx].min(axis=1).sum(axis=1)
    low, high = np.percentile(d_tot / c_tot, [2.5, 97.5])
    return (float(low), float(high))
