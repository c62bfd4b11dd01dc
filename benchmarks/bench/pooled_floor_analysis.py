"""Offline: would a pooled dense floor tighten the bench's W17 candidate CIs? (Evaluated, not adopted.)

For each ``results.json`` given, every dense generation of the run (the control pairs' both arms and each
candidate's dense arm: the same model doing the same work) is pooled; the pooled floor is the per-step minimum over
the pool, summed. Each candidate's speedup is then pooled floor / its own step floor, with a percentile bootstrap
that resamples the candidate's rounds and the pool. Printed per candidate beside the shipped step-floor estimator:
speedup and half-width of both, the bias of a pooled minimum (the pooled floor against the mean floor of random
subsets as large as the candidate's round count) and the candidate's own dense floor over the pooled one.

    python benchmarks/bench/pooled_floor_analysis.py benchmarks/results/h200-2026-12-02g/w17a_results-9601c75.json
"""

from __future__ import annotations

import json
import sys

import numpy as np


def analyze(path: str, resamples: int = 2000) -> tuple[int, int, int]:
    r = json.load(open(path))
    control = r["dense"]["control"]
    pool = [np.asarray(x) for arm in ("dense", "candidate") for x in control["steps_s"][arm]]
    for c in r["candidates"]:
        speed = c.get("speed") or {}
        pool += [np.asarray(x) for x in (speed.get("steps_s") or {}).get("dense", [])]
    steps = max(len(x) for x in pool)
    pool_m = np.asarray([x for x in pool if len(x) == steps])
    pooled = pool_m.min(0).sum()
    print(f"{path}: {len(pool_m)} dense generations pooled, floor {pooled:.4f} s, noise floor {r['noise_floor']:.4f}")
    rng = np.random.default_rng(0)
    counts = [0, 0, 0]
    for c in r["candidates"]:
        speed = c.get("speed") or {}
        if not speed.get("steps_s"):
            continue
        cand = np.asarray(speed["steps_s"]["candidate"])
        dense = np.asarray(speed["steps_s"]["dense"])
        c_floor = cand.min(0).sum()
        c_boot = cand[rng.integers(0, len(cand), (resamples, len(cand)))].min(1).sum(1)
        p_boot = pool_m[rng.integers(0, len(pool_m), (resamples, len(pool_m)))].min(1).sum(1)
        low, high = np.percentile(p_boot / c_boot, [2.5, 97.5])
        ratio = pooled / c_floor
        half = max(ratio - low, high - ratio) / ratio
        subsets = [pool_m[rng.choice(len(pool_m), len(cand), replace=False)].min(0).sum() for _ in range(500)]
        counts[0] += 1
        counts[1] += speed["halfwidth"] <= 0.02
        counts[2] += half <= 0.02
        print(f"  {c['name']:34} step floor {speed['speedup']:.3f} ±{speed['halfwidth']:.3f} | pooled {ratio:.3f} "
              f"±{half:.3f} | pooled-minimum bias {np.mean(subsets) / pooled:.4f} | own dense floor / pooled "
              f"{dense.min(0).sum() / pooled:.3f}")
    print(f"  rows with half-width <= 2 %: step floor {counts[1]}, pooled {counts[2]}, of {counts[0]}")
    return tuple(counts)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        analyze(arg)
