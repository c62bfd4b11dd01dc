"""Retaking the noise floor at the end of a run, when the control pairs timed at its start made it the binding part
of the decision threshold.

The noise floor is the upper bound of the dense-vs-dense control pairs' CI, timed once, before the candidates. On a
shared host a slow phase during those few rounds sets it high for the whole run: at W17 on an H200 (run T,
``b1a3855``) six control rounds read [0.982, 1.061], so the run carried the noisy-host banner and no speed verdict,
while only 14 % of its timed generations ran in a slow phase, the candidates' CIs were as narrow as 0.2 %, and 59 s
of the run budget were left unused.

When the floor is above ``1 + min_gain`` (it, not the minimum gain, sets the threshold) and the run budget has
slack once every row has run (before the peers), :func:`retake_control` continues the same control pair from the
rounds it has (``run_rounds(prior=...)``): the new rounds are pooled with the first ones, never substituted for them, so a
retake cannot pick the better of two measurements. It adds rounds until the pair's half-width reaches the control
target, the control's time budget is spent, or the run budget has no room for another round. The bench then
decides the noise floor, the noisy-host banner, the decision threshold and every speed verdict again from the
pooled pair (the candidates' rounds are not rerun; the settling pass comes after, against the new threshold). A
floor already at or under ``1 + min_gain`` is not retaken: the same direction of optional stopping as the
candidates' own adaptive rounds, which stop once narrow.

Every second of a retake is optional time of the run budget (``extended_s``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from worldfoundry.bench.run_budget import RunBudget
from worldfoundry.bench.timing import TimingPolicy, ci_halfwidth, run_rounds


def needs_retake(noise_floor: float, min_gain: float) -> bool:
    """Whether the noise floor is the binding part of the decision threshold (above ``1 + min_gain``)."""
    return noise_floor > 1.0 + max(0.0, min_gain)


def round_price_s(control: Mapping[str, Any]) -> float:
    """What one more control round costs at least: two generations at the slower arm's median."""
    per_generation = max(float(control.get("dense_median_s") or 0.0), float(control.get("candidate_median_s") or 0.0))
    return 2.0 * per_generation


def _brief(summary: Mapping[str, Any]) -> dict[str, Any]:
    return {"rounds": int(summary["rounds"]), "ci95": [float(v) for v in summary["ci95"]],
            "halfwidth": ci_halfwidth(summary), "noise_floor": max(1.0, float(summary["ci95"][1]))}


def retake_control(control: Mapping[str, Any], pair: Callable[[int], Any], policy: TimingPolicy,
                   budget: RunBudget, *, warm: Callable[[], Any],
                   clock: Callable[[], float] = time.perf_counter) -> tuple[dict[str, Any], dict[str, Any]]:
    """Continue the control pair ``control`` (a :func:`~worldfoundry.bench.timing.run_rounds` summary) with
    ``pair(r)`` under the control ``policy`` (its ``target_halfwidth``, ``budget_s`` and ``max_rounds`` bound the
    rounds added), each round only when ``budget`` allows it.

    Args:
        warm: one untimed generation through the timed path, run once before the first new round (the peers that
            ran before may leave one-off costs behind).

    Returns:
        ``(summary, record)``: the pooled summary (``control`` itself when no round was added) and
        ``{"before", "after", "rounds_added", "seconds", "stopped"}`` (``stopped``: ``"target"``, ``"budget"``,
        ``"max_rounds"`` or ``"run_budget"``).
    """
    began = clock()
    summary: dict[str, Any] = dict(control)
    price = round_price_s(control)
    stopped, added = "max_rounds", 0
    limit = int(control["rounds"]) + policy.max_rounds
    rules = replace(policy, threshold=None, dense_reference=None, run_budget=None, width_pool=None,
                    verdict_only=False)
    while int(summary["rounds"]) < limit:
        if ci_halfwidth(summary) <= policy.target_halfwidth:
            stopped = "target"
            break
        if clock() - began >= policy.budget_s:
            stopped = "budget"
            break
        if not budget.allow(price + (price / 2.0 if added == 0 else 0.0)):  # the first round pays the warm-up
            stopped = "run_budget"
            break
        if added == 0:
            warm()
        n = int(summary["rounds"]) + 1
        summary = run_rounds(pair, replace(rules, min_rounds=n, max_rounds=n), prior=summary, clock=clock)
        added += 1
    seconds = clock() - began
    budget.extended_s += seconds
    if added:
        summary["stopped"] = stopped
    record = {"before": _brief(control), "after": _brief(summary), "rounds_added": added,
              "seconds": round(seconds, 3), "stopped": stopped}
    return summary, record


__all__ = ["needs_retake", "retake_control", "round_price_s"]
