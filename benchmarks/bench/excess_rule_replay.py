#!/usr/bin/env python3
"""Offline: which recorded ``recommended`` verdicts the slowed-dense-arm rule withholds.

:func:`worldfoundry.bench.stats.verdict_low` divides a CI's lower bound by ``1 + dense_excess`` when the pair's
dense arm stayed that much above the run's dense floor (by more than the target half-width) and the pair's own
estimate was kept (the candidate was host-bound; a device-bound one is estimated against the run's dense floor
instead). This replays that rule on every bench ``results.json`` given (or found under ``benchmarks/results``)
that recorded ``dense_excess``: per candidate name, how many of its speed verdicts it keeps and how many
``recommended`` it withholds, then each withheld row with its run, estimate, CI and excess.

    python benchmarks/bench/excess_rule_replay.py                       # every recorded run
    python benchmarks/bench/excess_rule_replay.py path/to/results.json  # some
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any

from worldfoundry.core.model_loading.recipes import project_root

SPEED_VERDICTS = ("recommended", "no_stable_gain")


def replayed(speed: dict[str, Any], threshold: float) -> str:
    """The verdict the rule gives a row that was ``recommended`` (its other verdicts are kept)."""
    excess, target = speed.get("dense_excess"), speed.get("target_halfwidth", 0.02)
    kept_pair = speed.get("dense_floor_source") != "run_reference"
    if excess is not None and excess > target and kept_pair and speed["ci95"][0] / (1.0 + excess) <= threshold:
        return "no_stable_gain"
    return "recommended"


def load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("candidates"), list) and data.get("decision_threshold")
    return data if ok else None


def main(argv: list[str]) -> int:
    root = project_root() / "benchmarks" / "results"
    paths = [Path(a) for a in argv] or sorted(root.rglob("*.json"))
    tally: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    withheld, runs = [], 0
    for path in paths:
        data = load(path)
        rows = [c for c in (data or {}).get("candidates", []) if "dense_excess" in (c.get("speed") or {})]
        if not rows:
            continue
        runs += 1
        for c in rows:
            verdict, speed = c["verdict"], c["speed"]
            if verdict not in SPEED_VERDICTS:
                continue
            new = replayed(speed, data["decision_threshold"]) if verdict == "recommended" else verdict
            tally[c["name"]]["kept" if new == verdict else "withheld"] += 1
            if new != verdict:
                withheld.append((str(path.relative_to(root)) if path.is_relative_to(root) else str(path), c["name"],
                                 speed["speedup"], speed["ci95"], speed["dense_excess"]))
    print(f"{runs} runs with dense_excess recorded")
    for name, counts in sorted(tally.items()):
        print(f"  {name:34} speed verdicts kept {counts['kept']:3}, recommended withheld {counts['withheld']}")
    for run, name, est, ci, excess in withheld:
        print(f"  withheld: {run}: {name} {est:.3f}x [{ci[0]:.3f}, {ci[1]:.3f}], dense arm {excess:.1%} slow")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
