#!/usr/bin/env python3
"""Both speedup estimators re-computed from a bench ``results.json`` (any run that kept its per-step times).

For the control pairs (when their steps were recorded) and every timed candidate: the paired median with its
bootstrap CI and the step floor (:mod:`worldfoundry.bench.floor`) with its CI, and both half-widths. Results
written before ``speed.groups`` existed carry no per-round seed: their rounds are then grouped as one seed
(``--pool-seeds`` forces that), which is right for candidates whose steps do the same work for every seed (exact
plugins), not for caches.

    python benchmarks/bench/reestimate.py benchmarks/results/h200-2026-12-01d/w17/w17a_results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from worldfoundry.bench.stats import summarize_speed


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
    args = p.parse_args(argv)
    data = json.loads(args.results.read_text(encoding="utf-8"))
    rows = [("control (dense vs dense)", data.get("dense", {}).get("control") or {})]
    rows += [(c["name"], c.get("speed") or {}) for c in data.get("candidates", [])]
    print(f"{'candidate':40} {'rounds':>6} | {'paired median [95% CI]':32} {'hw':>6} | "
          f"{'step floor [95% CI]':32} {'hw':>6}")
    for name, speed in rows:
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
        print(f"{name:40} {got['rounds']:>6} | {cells[0]} | {cells[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
