"""The noise floor's retake: the control pair continues at the end of a run when its floor set the threshold."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.bench.fakes import Clock, exact_registry, timed, tiny_candidates
from worldfoundry.bench import harness, retake
from worldfoundry.bench.harness import BenchConfig, run_bench
from worldfoundry.bench.retake import needs_retake, retake_control, round_price_s
from worldfoundry.bench.run_budget import RunBudget
from worldfoundry.bench.timing import Timed, TimingPolicy, ci_halfwidth, run_rounds, samples


def _control(ratios: list[float]) -> tuple[list[tuple[Timed, Timed]], dict]:
    """Control rounds whose first arm ran ``q`` times slower (a slow phase of the host)."""
    rows = [(timed(q), timed(1.0)) for q in ratios]
    first = run_rounds(lambda r: rows[r], TimingPolicy(min_rounds=len(rows), max_rounds=len(rows)), clock=Clock())
    return rows, first


@pytest.mark.parametrize("floor, gain, expected", [(1.061, 0.02, True), (1.0245, 0.02, True), (1.02, 0.02, False),
                                                   (1.0, 0.02, False), (1.01, 0.0, True), (1.01, -0.5, True)])
def test_a_retake_is_needed_only_where_the_floor_sets_the_threshold(floor, gain, expected) -> None:
    assert needs_retake(floor, gain) is expected


def test_the_control_pair_continues_pooled_until_its_target_and_pays_as_optional_time() -> None:
    """The first rounds stay in the estimate (never replaced), the pair is called from the next round on, the
    warm-up runs once before the first new round, and every second counts as the run budget's optional time."""
    rows, first = _control([1.3, 1.0, 1.25, 1.1, 1.2, 1.15])
    rows += [(timed(1.0), timed(1.0))] * 40
    clock, called, warmed = Clock(), [], []
    budget = RunBudget(1000.0, tail_s=0.0, clock=clock)
    budget.plan(items=0, first_item_s=1.0)

    def pair(r: int):
        called.append(r)
        clock.now += 2.0
        return rows[r]

    policy = TimingPolicy(min_rounds=6, max_rounds=40, target_halfwidth=0.01, budget_s=1000.0)
    summary, record = retake_control(first, pair, policy, budget, warm=lambda: warmed.append(clock.now),
                                     clock=clock)
    dense, cand = samples(summary)
    assert called[0] == first["rounds"] and called == list(range(first["rounds"], summary["rounds"]))
    assert dense[:first["rounds"]] == samples(first)[0] and cand[:first["rounds"]] == samples(first)[1]
    assert warmed == [0.0] and record["rounds_added"] == len(called) > 0 and record["stopped"] == "target"
    assert ci_halfwidth(summary) <= 0.01 < ci_halfwidth(first) and summary["stopped"] == "target"
    assert record["before"]["noise_floor"] > record["after"]["noise_floor"]
    assert budget.extended_s == pytest.approx(record["seconds"]) == pytest.approx(2.0 * len(called))


def test_a_retake_takes_nothing_the_run_budget_does_not_have() -> None:
    rows, first = _control([1.3, 1.0, 1.25, 1.1])
    clock = Clock()
    budget = RunBudget(10.0, tail_s=0.0, clock=clock)
    budget.plan(items=0, first_item_s=1.0)
    clock.now = 10.0 - round_price_s(first)  # one round fits, its warm-up does not
    summary, record = retake_control(first, lambda r: pytest.fail("no round fits"), TimingPolicy(), budget,
                                     warm=lambda: pytest.fail("no warm-up either"), clock=clock)
    assert summary == first and record["rounds_added"] == 0 and record["stopped"] == "run_budget"
    assert record["before"] == record["after"] and budget.cut == 1


@settings(max_examples=15, deadline=None)
@given(st.lists(st.floats(1.0, 1.4), min_size=4, max_size=6), st.lists(st.floats(0.9, 1.1), min_size=3,
                                                                          max_size=8),
       st.floats(0.5, 30.0))
def test_a_retake_never_exceeds_its_rounds_time_or_the_run_budget(first_ratios, more, budget_s) -> None:
    """Whatever the timings: at most ``max_rounds`` rounds added, none started past the control's time budget,
    and none the run budget refused (its slack never goes negative because of the retake)."""
    rows, first = _control(first_ratios)
    rows += [(timed(q), timed(1.0)) for q in more * 10]
    clock = Clock()
    budget = RunBudget(budget_s + 5.0, tail_s=0.0, clock=clock)
    budget.plan(items=0, first_item_s=1.0)
    clock.now = 5.0

    def pair(r: int):
        assert budget.slack_s() >= 0.0
        clock.now += 2.0
        return rows[r]

    policy = TimingPolicy(min_rounds=3, max_rounds=len(more), target_halfwidth=1e-9, budget_s=12.0)
    summary, record = retake_control(first, pair, policy, budget, warm=lambda: None, clock=clock)
    assert record["rounds_added"] <= len(more) and summary["rounds"] == first["rounds"] + record["rounds_added"]
    assert record["seconds"] <= 12.0 + 2.0 and budget.slack_s() >= -1e-9


def test_a_bench_run_retakes_a_noisy_floor_and_decides_every_verdict_again(tmp_path: Path, monkeypatch) -> None:
    """On the tiny model, with a run budget: a control pair whose floor declared the host noisy (no speed verdicts)
    is continued after every row; once its pooled floor is under the noisy limit, the banner goes, the threshold is
    the new floor's and every timed row gets a speed verdict; the report says what the retake did."""
    path = tiny_candidates(tmp_path)
    real = harness._control_pairs

    def wide_first(runner, dense, seeds, policy):  # the real control pair, its CI read as a slow phase would
        return dict(real(runner, dense, seeds, policy), ci95=[0.9, 1.3])

    def narrow_after(control, pair, policy, budget, *, warm, clock):
        summary, record = retake_control(control, pair, policy, budget, warm=warm, clock=clock)
        summary = dict(summary, ci95=[0.999, 1.004])
        record["after"] = retake._brief(summary)
        return summary, record

    monkeypatch.setattr(harness, "_control_pairs", wide_first)
    monkeypatch.setattr(harness, "retake_control", narrow_after)
    out = tmp_path / "o"
    results = run_bench(BenchConfig(model="tiny-wan2.1", candidates=str(path), out=str(out), run_budget_s=600.0,
                                    progress=False), registry=exact_registry())
    record = results["retake"]
    assert record["before"]["noise_floor"] == pytest.approx(1.3) and record["after"]["noise_floor"] == 1.004
    assert results["noise_floor"] == 1.004 and results["noisy_host"] is None
    assert results["decision_threshold"] == pytest.approx(1.02) == results["timing_policy"]["threshold"]
    assert [c["verdict"] for c in results["candidates"]] != ["noisy_host"] * 2
    assert all(c["verdict"] in ("recommended", "no_stable_gain", "invalid_timing") for c in results["candidates"])
    assert results["wall_s"]["retake"] > 0 and results["dense"]["stable_after_candidates"]
    report = (out / "report.md").read_text()
    assert "NOISY HOST" not in report and "noise floor retake" in report and "decided again" in report


def test_a_floor_under_the_minimum_gain_is_not_retaken(tmp_path: Path, monkeypatch) -> None:
    path = tiny_candidates(tmp_path, ["a"])
    real = harness._control_pairs
    monkeypatch.setattr(harness, "_control_pairs",
                        lambda *a: dict(real(*a), ci95=[0.99, 1.01]))
    monkeypatch.setattr(harness, "retake_control", lambda *a, **k: pytest.fail("not needed"))
    results = run_bench(BenchConfig(model="tiny-wan2.1", candidates=str(path), out=str(tmp_path / "o"),
                                    run_budget_s=600.0, progress=False), registry=exact_registry())
    assert "retake" not in results and "retake" not in results["wall_s"] and results["noise_floor"] == 1.01
