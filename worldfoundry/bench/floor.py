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

A pair whose dense floor still sits above the run's reference when its rounds end (see below) is estimated
against that reference instead (:func:`reference_step_floor`: the run's fastest dense time of every step over the
pair's candidate floor, its CI resampling the candidate's rounds only): its own dense arm was measurably slowed by
the host, which would inflate the speedup (on a noisy H200 host a CUDA-graph stack read 2.10× against its slowed
dense arm and 1.51× against the run's dense floor).

:class:`DenseFloorReference` keeps, over a whole run, the fastest dense time of every step of every seed (control
pairs and each candidate's dense arm: the same model doing the same work). A pair whose dense floor sits well above
it was timed in a slow phase of the host that outlasted the pair, which a floor of a few rounds cannot remove; the
timing loop gives such a pair more rounds (:func:`worldfoundry.bench.timing.run_rounds`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: Bootstrap resamples of the step-floor CI.
RESAMPLES = 2000
#: Fewest rounds a seed is timed with the step floor. A percentile bootstrap over ``n`` rounds puts ``n * n**-n`` of
#: its mass on resamples that repeat one round: 11 % at 3 rounds, so both ends of a 95 % CI are then the floors of
#: single rounds and one burst in one round sets the CI's width; 1.6 % at 4 rounds.
MIN_ROUNDS = 4


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


class DenseFloorReference:
    """Per seed, the per-step minimum dense times seen so far in a run.

    Example::

        ref = DenseFloorReference()
        ref.update([[0.08, 0.08], [0.09, 0.07]], [42, 42])
        ref.floor([42])   # 0.15
    """

    def __init__(self) -> None:
        self._mins: dict[Any, np.ndarray] = {}

    def update(self, steps: Sequence[Sequence[float]], groups: Sequence[Any]) -> None:
        """Fold in dense generations: per round its step times and its seed (rounds whose step count differs from
        what the seed has shown before are ignored: they cannot be lined up)."""
        for row, group in zip(steps, groups):
            if not row:
                continue
            times = np.asarray(row, dtype=np.float64)
            held = self._mins.get(group)
            if held is None:
                self._mins[group] = times.copy()
            elif held.shape == times.shape:
                np.minimum(held, times, out=held)

    def floor(self, groups: Sequence[Any]) -> float | None:
        """The reference dense floor of the seeds in ``groups`` (summed), or ``None`` when a seed is unknown."""
        seeds = list(dict.fromkeys(groups))
        if not seeds or any(g not in self._mins for g in seeds):
            return None
        return float(sum(self._mins[g].sum() for g in seeds))

    def to_json(self) -> dict[str, float]:
        """Per seed, the reference floor in seconds."""
        return {str(g): float(v.sum()) for g, v in self._mins.items()}


def reference_step_floor(cand: Sequence[Sequence[float]], groups: Sequence[Any],
                         reference: DenseFloorReference) -> dict[str, Any] | None:
    """The step-floor speedup of ``cand`` against ``reference``'s dense floor of the same seeds, with a
    seed-stratified percentile bootstrap of the candidate's rounds; ``None`` when a seed is unknown to the
    reference or the step lists do not line up."""
    parts = _grouped(cand, cand, groups)
    ref = reference.floor(groups)
    if parts is None or not ref:
        return None
    c_floor = sum(float(c.min(axis=0).sum()) for _, c in parts)
    if not c_floor > 0:
        return None
    ci: tuple[float, float] = (float("nan"), float("nan"))
    if all(c.shape[0] >= 2 for _, c in parts):
        rng = np.random.default_rng(0)
        c_tot = np.zeros(RESAMPLES)
        for _, c in parts:
            c_tot += c[rng.integers(0, c.shape[0], size=(RESAMPLES, c.shape[0]))].min(axis=1).sum(axis=1)
        low, high = np.percentile(ref / c_tot, [2.5, 97.5])
        ci = (float(low), float(high))
    return {"speedup": ref / c_floor, "ci95": list(ci), "dense_floor_s": ref, "candidate_floor_s": c_floor}


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
