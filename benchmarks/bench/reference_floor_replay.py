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

``--bias FILE...``: per run, the median over its pairs of how far a pair's own dense floor sits above the run's
dense generations as they stood when the pair ended, taken three ways: their fastest time of every step (the
harness's reference: a minimum over forty to seventy generations, where the pair's is over four or five), the
floor those generations give at the pair's number of rounds (per step, the expected minimum of that many drawn
without replacement), and the same over the generations whose total is within ``--quiet`` (default 5 %) of the
fastest (slow-phase generations left out); then the medians over all pairs of all files.

    python benchmarks/bench/reference_floor_replay.py --bias benchmarks/results/h200-2026-12-0*/w17*_results-*.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from worldfoundry.bench.floor import DenseFloorReference
from worldfoundry.bench.timing import TimingPolicy, ci_halfwidth, dense_excess, reference_fallback

SPEED_VERDICTS = ("recommended", "no_stable_gain")


def replay(results: dict[str, Any], device_bound: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Per timed candidate: name, recorded and replayed estimate/CI/half-width, dense excess, verdicts
    (candidates without recorded host times whose name contains one of ``device_bound`` are assumed
    device-bound)."""
    reference = _seeded(results)
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


def expected_min(times: np.ndarray, k: int) -> np.ndarray:
    """Per column of ``times`` (``[n, steps]``), the expected minimum of ``k`` rows drawn without replacement (the
    ``i``-th smallest value, from 0, is the minimum with probability ``C(n-1-i, k-1) / C(n, k)``)."""
    n = times.shape[0]
    if k >= n:
        return times.min(axis=0)
    weights = np.array([math.comb(n - 1 - i, k - 1) for i in range(n)], dtype=np.float64) / math.comb(n, k)
    return weights @ np.sort(times, axis=0)


def excess_pairs(results: dict[str, Any], quiet: float = 0.05) -> list[tuple[float, float, float]]:
    """Per timed candidate, its dense floor over the run's dense generations when it ended: (fastest,
    rounds-matched, rounds-matched over the generations within ``quiet`` of the fastest)."""
    pool: dict[Any, list[np.ndarray]] = {}

    def add(rows: list[list[float]], groups: list[Any]) -> None:
        for row, group in zip(rows, groups):
            held = pool.setdefault(group, [])
            if row and (not held or held[0].shape == (len(row),)):
                held.append(np.asarray(row, dtype=np.float64))

    control = results["dense"]["control"]
    for arm in ("dense", "candidate"):
        add((control.get("steps_s") or {}).get(arm) or [], control.get("groups") or [])
    out = []
    for cand in results["candidates"]:
        speed = cand.get("speed")
        if not speed or not speed.get("step_floor") or not speed.get("steps_s"):
            continue
        counts: dict[Any, int] = {}
        for group in speed["groups"]:
            counts[group] = counts.get(group, 0) + 1
        if all(pool.get(g) for g in counts):
            refs = np.zeros(3)
            for group, k in counts.items():
                times = np.stack(pool[group])
                calm = times[times.sum(axis=1) <= times.sum(axis=1).min() * (1.0 + quiet)]
                refs += [times.min(axis=0).sum(), expected_min(times, k).sum(), expected_min(calm, k).sum()]
            own = speed["step_floor"]["dense_floor_s"]
            out.append(tuple(float(own / ref - 1.0) for ref in refs))
        add(speed["steps_s"]["dense"], speed["groups"])
    return out


def _seeded(results: dict[str, Any]) -> DenseFloorReference:
    """The run's reference as the harness seeds it: both arms of the control pairs."""
    reference = DenseFloorReference()
    control = results["dense"]["control"]
    for arm in ("dense", "candidate"):
        reference.update((control.get("steps_s") or {}).get(arm) or [], control.get("groups") or [])
    return reference


def _bias(paths: list[Path], quiet: float) -> int:
    every: list[tuple[float, float, float]] = []
    print(f"{'run':40s} pairs  above: fastest  rounds-matched  rounds-matched within {quiet:.0%} of the fastest")
    for path in paths:
        pairs = excess_pairs(json.loads(path.read_text()), quiet)
        every += pairs
        if pairs:
            print(_bias_line(path.name, pairs))
    if every:
        print(_bias_line("all", every))
    return 0


def _bias_line(name: str, pairs: list[tuple[float, float, float]]) -> str:
    medians = [statistics.median(p[i] for p in pairs) for i in range(3)]
    return f"{name:40s} {len(pairs):5d}  {medians[0]:+13.2%}  {medians[1]:+14.2%}  {medians[2]:+14.2%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--bias", action="store_true",
                        help="print how far the pairs' dense floors sit above the run's reference (module docstring)")
    parser.add_argument("--quiet", type=float, default=0.05,
                        help="--bias: generations within this of the fastest count as quiet (default 0.05)")
    parser.add_argument("--device-bound", action="append", default=[], metavar="SUBSTRING",
                        help="treat candidates without recorded host times whose name contains this as device-bound "
                             "(repeatable)")
    args = parser.parse_args()
    try:
        if args.bias:
            return _bias(args.results, args.quiet)
        for path in args.results:
            _print_replay(path, replay(json.loads(path.read_text()), tuple(args.device_bound)), args.json)
    except (OSError, ValueError, KeyError) as exc:
        print(f"reference_floor_replay: cannot replay ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    return 0


def _print_replay(path: Path, rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{path.name}\n{'candidate':58s} {'excess':>7s} {'source':>13s} {'recorded':>24s} {'replayed':>24s}  "
          "verdict -> replayed")
    for r in rows:
        rec, rep = r["recorded"], r["replayed"]
        excess = "-" if r["dense_excess"] is None else f"{r['dense_excess']:+.1%}"
        name = r["name"] + (" (assumed device-bound)" if r["assumed_device_bound"] else "")
        print(f"{name:58s} {excess:>7s} {r['source']:>13s} {rec[0]:8.3f} ±{rec[2]:6.1%}          "
              f"{rep[0]:8.3f} ±{rep[2]:6.1%}         {r['verdict']} -> {r['replayed_verdict']}")


if __name__ == "__main__":
    sys.exit(main())
