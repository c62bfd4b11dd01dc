#!/usr/bin/env python3
"""Both speedup estimators re-computed from a bench ``results.json`` (any run that kept its per-step times).

For the control pairs (when their steps were recorded) and every timed candidate: the paired median with its
bootstrap CI and the step floor (:mod:`worldfoundry.bench.floor`) with its CI, and both half-widths. Results
written before ``speed.groups`` existed carry no per-round seed: their rounds are then grouped as one seed
(``--pool-seeds`` forces that), which is right for candidates whose steps do the same work for every seed (exact
plugins), not for caches.

    python benchmarks/bench/reestimate.py benchmarks/results/h200-2026-12-01d/w17/w17a_results.json

With ``--min-gain G`` the last column re-decides each timed candidate's speed verdict on the step floor under
the current rule (:func:`worldfoundry.bench.stats.decision_threshold`: CI lower bound above max(the run's noise
floor, 1 + G)); candidates whose recorded verdict is not a speed verdict keep it.

    python benchmarks/bench/reestimate.py --min-gain 0.02 benchmarks/results/h200-2026-12-02/w17-d3fca8c/w17b_results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from worldfoundry.bench.stats import decision_threshold, summarize_speed

SPEED_VERDICTS = ("recommended", "no_stable_gain")


def _halfwidth(estimate: float, ci: list[float]) -> float:
    return (ci[1] - ci[0]) / 2 / estimate if estimate and ci[0] == ci[0] else float("nan")


def reestimate(speed: dict[str, Any], pool: bool) -> dict[str, Any] | None:
    """``{"paired": (est, ci, hw), "step_floor": (est, ci, hw) or None}`` of one speed record."""
    steps = speed.get("steps_s")
    if not steps or not steps.get("dense"):
        return None
    groups = speed.get("groups")
    if pool or not groups:
        groups = [0] * len(steps["dense"])
    out = summarize_speed(list(speed["dense_s"]), list(speed["candidate_s"]), steps=steps, groups=groups)
    paired = (out["paired_median"], out["paired_ci95"], _halfwidth(out["paired_median"], out["paired_ci95"]))
    floor = out.get("step_floor")
    return {"rounds": len(steps["dense"]), "paired": paired,
            "step_floor": (floor["speedup"], floor["ci95"], _halfwidth(floor["speedup"], floor["ci95"]))
            if floor else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--pool-seeds", action="store_true", help="group every round as one seed")
    p.add_argument("--min-gain", type=float, default=None,
                   help="re-decide the speed verdicts with this minimum gain (and the run's noise floor)")
    args = p.parse_args(argv)
    data = json.loads(args.results.read_text(encoding="utf-8"))
    threshold = (decision_threshold(float(data.get("noise_floor") or 1.0), args.min_gain)
                 if args.min_gain is not None else None)
    rows = [("control (dense vs dense)", data.get("dense", {}).get("control") or {}, None)]
    rows += [(c["name"], c.get("speed") or {}, c.get("verdict")) for c in data.get("candidates", [])]
    print(f"{'candidate':40} {'rounds':>6} | {'paired median [95% CI]':32} {'hw':>6} | "
          f"{'step floor [95% CI]':32} {'hw':>6}" + ("" if threshold is None else f" | verdict at {threshold:.4f}"))
    for name, speed, verdict in rows:
        got = reestimate(speed, args.pool_seeds) if speed else None
        if got is None:
            print(f"{name:40} {'-':>6} | no per-step times recorded")
            continue
        cells = []
        for key in ("paired", "step_floor"):
            if got[key] is None:
                cells.append(f"{'-':32} {'-':>6}")
                continue
            est, ci, hw = got[key]
            cells.append(f"{est:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]{'':14} {hw:6.1%}")
        line = f"{name:40} {got['rounds']:>6} | {cells[0]} | {cells[1]}"
        if threshold is not None and verdict is not None:
            floor = got["step_floor"]
            if verdict in SPEED_VERDICTS and floor is not None:
                verdict = "recommended" if floor[1][0] > threshold else "no_stable_gain"
            line += f" | {verdict}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
