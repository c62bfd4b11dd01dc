#!/usr/bin/env python3
"""Replay a bench ``results.json`` under the dense-reference rule of :func:`worldfoundry.bench.timing.run_rounds`.

A pair whose dense floor is still more than the target half-width above the run's dense reference when its rounds
end, and whose candidate was bound by the device, is estimated against that reference
(:func:`worldfoundry.bench.timing.reference_fallback`). This rebuilds the reference as the harness does -- both arms
of the control pairs first, then each candidate's dense arm after that candidate -- and prints, per timed
candidate, the recorded estimate and the one the rule gives, with their half-widths and the verdict under the run's
decision threshold.

Runs recorded before the host part of each step was (``speed.host_steps_s``) cannot say which candidates were
device-bound: the rule then keeps every pair's own estimate, unless ``--device-bound SUBSTRING`` names candidates
to treat as device-bound (an assumption the output states, e.g. ``cuda-graph``: a graph replay is one launch).

    python benchmarks/bench/reference_floor_replay.py --device-bound cuda-graph \
        benchmarks/results/h200-2026-12-02i/w17b_results-321f2cc.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

from worldfoundry.bench.floor import DenseFloorReference
from worldfoundry.bench.timing import TimingPolicy, ci_halfwidth, dense_excess, reference_fallback

SPEED_VERDICTS = ("recommended", "no_stable_gain")


def replay(results: dict[str, Any], device_bound: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Per timed candidate: name, recorded and replayed estimate/CI/half-width, dense excess, verdicts
    (candidates without recorded host times whose name contains one of ``device_bound`` are assumed
    device-bound)."""
    reference = DenseFloorReference()
    control = results["dense"]["control"]
    for arm in ("dense", "candidate"):
        reference.update((control.get("steps_s") or {}).get(arm) or [], control.get("groups") or [])
    target = float(results["timing_policy"]["target_halfwidth"])
    threshold = float(results["decision_threshold"])
    policy = TimingPolicy(target_halfwidth=target, dense_reference=reference)
    rows = []
    for cand in results["candidates"]:
        speed = cand.get("speed")
        if not speed or not speed.get("steps_s") or speed.get("estimator") != "step_floor":
            continue
        summary = copy.deepcopy(speed)
        for key in ("pair_estimate", "dense_floor_source", "reference_step_floor"):  # a run made with the rule
            summary.pop(key, None)
        if "pair_estimate" in speed:
            summary.update(speedup=speed["pair_estimate"]["speedup"], ci95=speed["pair_estimate"]["ci95"])
        assumed = not summary.get("host_steps_s") and any(p in cand["name"] for p in device_bound)
        if assumed:  # the host's part of each step taken as 0: what a device-bound candidate would have shown
            summary["host_steps_s"] = {"candidate": [[0.0] * len(x) for x in summary["steps_s"]["candidate"]]}
        excess = dense_excess(summary, reference)
        reference_fallback(summary, policy, excess)
        verdict = cand["verdict"]
        if verdict in SPEED_VERDICTS:
            verdict = "recommended" if summary["ci95"][0] > threshold else "no_stable_gain"
        rows.append({"name": cand["name"], "recorded": (speed["speedup"], speed["ci95"], ci_halfwidth(speed)),
                     "replayed": (summary["speedup"], summary["ci95"], ci_halfwidth(summary)),
                     "dense_excess": excess, "source": summary.get("dense_floor_source", "pair"),
                     "assumed_device_bound": assumed,
                     "verdict": cand["verdict"], "replayed_verdict": verdict})
        reference.update(speed["steps_s"]["dense"], speed["groups"])  # as the harness does after each candidate
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--device-bound", action="append", default=[], metavar="SUBSTRING",
                        help="treat candidates without recorded host times whose name contains this as device-bound "
                             "(repeatable)")
    args = parser.parse_args()
    try:
        rows = replay(json.loads(args.results.read_text()), tuple(args.device_bound))
    except (OSError, ValueError, KeyError) as exc:
        print(f"reference_floor_replay: {args.results}: cannot replay ({exc})", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'candidate':58s} {'excess':>7s} {'source':>13s} {'recorded':>24s} {'replayed':>24s}  verdict -> replayed")
    for r in rows:
        rec, rep = r["recorded"], r["replayed"]
        excess = "-" if r["dense_excess"] is None else f"{r['dense_excess']:+.1%}"
        name = r["name"] + (" (assumed device-bound)" if r["assumed_device_bound"] else "")
        print(f"{name:58s} {excess:>7s} {r['source']:>13s} {rec[0]:8.3f} ±{rec[2]:6.1%}          "
              f"{rep[0]:8.3f} ±{rep[2]:6.1%}         {r['verdict']} -> {r['replayed_verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
