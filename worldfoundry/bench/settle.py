"""The settling pass: more rounds, at the end of a run, for the candidates whose speed verdict was not settled.

In the first pass each candidate is timed in turn, and one whose CI still straddles the decision threshold (or
clears it by no more than the verdict margin: :func:`~worldfoundry.bench.timing.undecided`), or whose dense arm
ran in a slow phase of the host, gets verdict rounds on the spot while the run budget has slack (:func:`unsettled`
says which verdicts a settling pass takes up). Early in a run that slack is also what the rows still to come and the
peers need, so a row's verdict rounds can be refused (``stopped: run_budget``), and its extension may simply run
out: either way its verdict could go the other way on a repeat run (at W17 on an H200 the stack
``cuda-graph+mha-self+static-kv`` read 1.023-1.045x over seven runs against a threshold of 1.02; it was
``recommended`` in each run whose rounds ended on the target and ``no_stable_gain`` in each run whose rounds the
run budget cut).

Once every row has run, and before the peers (their mandatory part stays in the run budget's reserve; their
rounds past it take what the pass leaves), the slack left in the run budget goes to those candidates, in their order
(:func:`settle_pass`): each is installed again, warmed by one generation that is checked against its pilot, and its
pair continues (:func:`~worldfoundry.bench.timing.switching_pairs` with ``prior``: the same step-floor estimate,
more rounds) while the verdict is undecided, for up to ``extend_factor * budget_s`` and while the run budget allows
each round; then its verdict is decided again. With ``widen``, a second part follows: every row whose verdict stands on a CI still wider than the target
half-width (:func:`wide`: its narrowing rounds decide no verdict, so while rows were still to come they were held
to its fair share of the slack) and that the first part did not take up is installed again the same way and its
pair continues under :func:`width_policy` (one block, then rounds until narrow or its time budget is spent); its
verdict is decided again. A wide row's rounds may take its share of the run budget's slack (the slack when its
turn comes, split evenly over it and the wide rows after it), never less than its time budget: rows are done, so
the slack is what the run has left over (at W17 on an H200 run B ended 84 s under its budget with ``fp8-ffn`` at
2.4 % after 12 rounds, its width rounds cut at its 6 s time budget). Every second of the pass is optional time of
the run budget
(``extended_s``). From the run's start the run budget keeps one candidate's price in its reserve for the pass
(:meth:`~worldfoundry.bench.run_budget.RunBudget.release_settle` gives it back when the pass starts, or after
the rows when no verdict is left unsettled): in two W17 runs on an H200 without it, host waits and width rounds had
spent the whole slack before the pass, which was refused. Without a run budget there is no pass: the first pass's
extension is then bounded only by ``extend_factor``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from worldfoundry.bench.timing import SWITCH_BLOCK, TimingPolicy, ci_halfwidth, undecided

#: Verdicts a settling pass may change: the speed verdicts, and ``invalid_timing`` (a speedup over the receipts'
#: bound, which a dense arm slowed by the host gives a cache that skipped nothing).
SPEED_VERDICTS = ("recommended", "no_stable_gain", "invalid_timing")


def unsettled(record: Mapping[str, Any], policy: TimingPolicy) -> bool:
    """Whether a candidate's speed verdict was not settled when its rounds ended: its CI undecided
    (:func:`~worldfoundry.bench.timing.undecided`), or its own pair's estimate kept with a dense arm that ran in a
    slow phase of the host (``dense_excess`` above the target half-width) by enough to change the verdict: the
    lower bound, deflated by that excess, no longer clears the threshold by the verdict margin, while the upper
    bound reaches it (a slowed dense arm inflates a host-bound candidate's speedup; at W17 on an H200 a cache that
    skipped nothing read 1.307x against a dense arm 33.5 % slow, ``invalid_timing``)."""
    speed = record.get("speed")
    if record.get("verdict") not in SPEED_VERDICTS or not speed or not speed.get("ci95"):
        return False
    if undecided(speed, policy.threshold, policy.verdict_margin):
        return True
    excess, threshold = speed.get("dense_excess"), policy.threshold
    if excess is None or threshold is None or excess <= policy.target_halfwidth:
        return False
    if speed.get("dense_floor_source") == "run_reference":  # already estimated against the run's dense floor
        return False
    low, high = speed["ci95"]
    return bool(high >= threshold and low / (1.0 + excess) <= threshold * (1.0 + policy.verdict_margin))


def wide(record: Mapping[str, Any], policy: TimingPolicy) -> bool:
    """Whether a candidate's speed verdict stands on a CI still wider than the target half-width when its rounds
    ended: the rounds that would only have narrowed it (they decide no verdict) are held to the row's fair share of
    the run budget's slack while rows are still to come, so a wide row early in a run can end with slack left over
    (W17 on an H200, run V: ``mha-fused`` 3.1 % after 5 rounds, 67 s of the budget unused)."""
    speed = record.get("speed")
    if record.get("verdict") not in SPEED_VERDICTS or not speed or not speed.get("ci95"):
        return False
    return ci_halfwidth(speed) > policy.target_halfwidth


def width_policy(policy: TimingPolicy, prior: Mapping[str, Any], budget_s: float | None = None) -> TimingPolicy:
    """The policy of a width pass over a pair that already ran ``prior["rounds"]`` rounds: one more block always,
    then rounds until the CI is narrow or ``budget_s`` seconds of rounds are spent (``None``, or less than the
    candidate's time budget: that budget), its verdict rounds as usual."""
    done = int(prior["rounds"])
    seconds = policy.budget_s if budget_s is None else max(policy.budget_s, float(budget_s))
    return replace(policy, min_rounds=done + SWITCH_BLOCK, max_rounds=done + policy.max_rounds, verdict_only=False,
                   width_pool=None, budget_s=seconds)


def settle_policy(policy: TimingPolicy, prior: Mapping[str, Any]) -> TimingPolicy:
    """The policy of a settling pass over a pair that already ran ``prior["rounds"]`` rounds: one more block
    always (the model is installed again for it), then verdict rounds only (``verdict_only``), up to
    ``max_rounds`` more."""
    done = int(prior["rounds"])
    return replace(policy, min_rounds=done + SWITCH_BLOCK, max_rounds=done + policy.max_rounds, verdict_only=True,
                   width_pool=None)


def pass_price_s(speed: Mapping[str, Any]) -> float:
    """What one settling pass costs at least: an installation and a warm generation (about a generation each) and
    the block of paired rounds it always runs."""
    per_generation = max(float(speed.get("dense_median_s") or 0.0), float(speed.get("candidate_median_s") or 0.0))
    return (2 * SWITCH_BLOCK + 2) * per_generation


def settle_pass(records: list[dict[str, Any]], policy: TimingPolicy,
                retime: Callable[[dict[str, Any]], None], *,
                clock: Callable[[], float] = time.perf_counter,
                widen: Callable[[dict[str, Any], float], None] | None = None) -> dict[str, Any]:
    """Run the settling pass over ``records`` (the bench's candidate records, in order): first every unsettled
    verdict, then (with ``widen``) every row whose CI is still wider than the target (:func:`wide`) and that the
    first part did not take up.

    Args:
        policy: the candidates' timing policy (its ``run_budget`` pays; ``None``: no pass).
        retime: ``retime(record)`` installs the record's candidate again, continues its pair with
            :func:`settle_policy` and decides its verdict again, updating ``record`` in place; it must leave the
            model dense.
        widen: ``widen(record, seconds)``: the same with :func:`width_policy` and ``budget_s=seconds`` (the row's
            share of the slack); ``None``: no width part.

    Returns:
        ``{"candidates": [...], "widened": [...], "refused": [...], "seconds": s}``: the names of the candidates
        whose verdict was retimed, of those retimed for their width, and of those the run budget had no room for.
    """
    out: dict[str, Any] = {"candidates": [], "widened": [], "refused": [], "seconds": 0.0}
    budget = policy.run_budget
    if budget is None:
        return out
    budget.release_settle()  # the candidate's price the reserve kept for this pass is now slack
    for record in [r for r in records if "settle" not in r and unsettled(r, policy)]:
        if not budget.allow(pass_price_s(record["speed"])):
            out["refused"].append(record["name"])
            continue
        out["seconds"] += _one(record, retime, budget, clock, "verdict")
        out["candidates"].append(record["name"])
    if widen is not None:
        rows = [r for r in records if "settle" not in r and wide(r, policy)]
        for left, record in zip(range(len(rows), 0, -1), rows):
            # a width pass may time rounds for the candidate's whole time budget before the run budget is asked
            fixed = pass_price_s(record["speed"])
            if not budget.allow(fixed + policy.budget_s):
                out["refused"].append(record["name"])
                continue
            seconds = budget.slack_s() / left - fixed  # its share of what the rows after it leave
            out["seconds"] += _one(record, lambda r, s=seconds: widen(r, s), budget, clock, "width")
            out["widened"].append(record["name"])
    out["seconds"] = round(out["seconds"], 3)
    return out


def _one(record: dict[str, Any], run: Callable[[dict[str, Any]], None], budget: Any,
         clock: Callable[[], float], reason: str) -> float:
    """One candidate's pass: ``run(record)``, its first result kept under ``record["settle"]["before"]`` (and
    standing if the pass raises), all its time optional time of ``budget``. Returns its seconds."""
    speed = record["speed"]
    before = {"verdict": record["verdict"], "speedup": speed["speedup"], "ci95": list(speed["ci95"]),
              "halfwidth": ci_halfwidth(speed), "rounds": speed["rounds"], "stopped": speed.get("stopped")}
    extended, began = budget.extended_s, clock()
    try:
        run(record)
    except Exception as exc:  # the first pass's result stands
        before["error"] = f"{type(exc).__name__}: {exc}"
    seconds = clock() - began
    budget.extended_s = extended + seconds  # the whole pass is optional time
    record["settle"] = {"before": before, "seconds": round(seconds, 3), "reason": reason}
    return seconds


__all__ = ["SPEED_VERDICTS", "pass_price_s", "settle_pass", "settle_policy", "unsettled", "wide", "width_policy"]
