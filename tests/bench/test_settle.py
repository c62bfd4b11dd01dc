"""The settling pass: candidates whose verdict was not settled get more rounds at the end of a run."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.bench.fakes import Clock, exact_registry, timed, tiny_candidates
from worldfoundry.bench import harness, settle
from worldfoundry.bench.harness import BenchConfig, run_bench
from worldfoundry.bench.run_budget import RunBudget
from worldfoundry.bench.settle import pass_price_s, settle_pass, settle_policy, unsettled, wide, width_policy
from worldfoundry.bench.timing import SWITCH_BLOCK, Arm, Timed, TimingPolicy, WidthPool, ci_halfwidth, run_rounds, \
    samples, switching_pairs


def _clock(step: float):
    counter = itertools.count()
    return lambda: next(counter) * step


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 2.0), st.floats(0.5, 2.0)), min_size=3, max_size=8))
def test_a_summary_gives_back_the_samples_it_was_made_of(pairs) -> None:
    rows = [(timed(d, seed=i % 2), timed(c, seed=i % 2)) for i, (d, c) in enumerate(pairs)]
    out = run_rounds(lambda r: rows[r], TimingPolicy(min_rounds=len(rows), max_rounds=len(rows)),
                     clock=_clock(0.0))
    dense, cand = samples(out)
    assert dense == [d for d, _ in rows] and cand == [c for _, c in rows]


def test_a_prior_summary_is_continued_not_restarted() -> None:
    """A second pass keeps the first pass's rounds, calls ``pair`` from the next round on, and the estimate is the
    one of all rounds together."""
    ratios = [1.0, 1.05, 1.0, 1.05] + [1.1] * 20
    rows = [(timed(1.0), timed(1.0 / q)) for q in ratios]
    first = run_rounds(lambda r: rows[r], TimingPolicy(min_rounds=4, max_rounds=4), clock=_clock(0.0))
    called = []

    def pair(r: int):
        called.append(r)
        return rows[r]

    second = run_rounds(pair, TimingPolicy(min_rounds=6, max_rounds=8), clock=_clock(0.0), prior=first)
    whole = run_rounds(lambda r: rows[r], TimingPolicy(min_rounds=second["rounds"], max_rounds=second["rounds"]),
                       clock=_clock(0.0))
    assert called[0] == 4 and second["rounds"] == 4 + len(called) >= 6
    assert second["dense_s"][:4] == first["dense_s"] and second["speedup"] == whole["speedup"]
    assert second["ci95"] == whole["ci95"]


def test_verdict_only_rounds_stop_once_the_verdict_is_decided() -> None:
    """Past its one mandatory block a settling pass adds rounds only while the CI is undecided: the first pass left
    it straddling the threshold, the new rounds are clearly faster, and the pass stops as soon as the lower bound
    clears the threshold by the margin."""
    ratios = [1.0, 1.05, 1.0, 1.05] + [1.3] * 30
    rows = [(1.0, 1.0 / q) for q in ratios]
    base = TimingPolicy(min_rounds=4, max_rounds=4, budget_s=4.0, threshold=1.02, estimator="paired_median")
    first = run_rounds(lambda r: rows[r], base, clock=_clock(1.0))
    assert unsettled({"verdict": "no_stable_gain", "speed": first}, base)
    out = run_rounds(lambda r: rows[r], settle_policy(replace(base, max_rounds=20), first), clock=_clock(1.0),
                     prior=first)
    assert out["stopped"] == "target" or out["ci95"][0] > 1.02 * 1.01
    assert 4 + SWITCH_BLOCK <= out["rounds"] < 24 and not unsettled({"verdict": "recommended", "speed": out}, base)


def test_verdict_only_rounds_never_draw_on_the_width_pool_and_stop_at_the_extended_budget() -> None:
    wide = [(1.0, 0.5), (1.0, 0.45)] * 30  # decided (clearly faster) but about 5 % wide
    pool = WidthPool(1e9)
    base = TimingPolicy(min_rounds=3, max_rounds=40, budget_s=4.0, threshold=1.02, estimator="paired_median",
                        width_pool=pool)
    first = run_rounds(lambda r: wide[r], replace(base, max_rounds=4, min_rounds=4, width_pool=None),
                       clock=_clock(0.0))
    out = run_rounds(lambda r: wide[r], replace(settle_policy(base, first), width_pool=pool), clock=_clock(1.0),
                     prior=first)
    assert out["rounds"] == 4 + SWITCH_BLOCK and out["widened"] == 0 and pool.spent == 0.0
    straddling = [(1.0, 1 / 0.9), (1.0, 1 / 1.2)] * 30
    first = run_rounds(lambda r: straddling[r], replace(base, max_rounds=4, min_rounds=4, width_pool=None),
                       clock=_clock(0.0))
    out = run_rounds(lambda r: straddling[r], settle_policy(base, first), clock=_clock(1.0), prior=first)
    # rounds 5 and 6 are the mandatory block; the clock (read from then on) allows 2 x 4 s of rounds in all
    assert out["stopped"] == "budget" and out["rounds"] < 4 + 40 and out["extended"] > 0


def test_switching_pairs_continue_the_blocks_of_a_prior_pass() -> None:
    log: list[str] = []
    state = {"active": "c"}

    def arm(name: str, seconds: float) -> Arm:
        def activate() -> bool:
            changed = state["active"] != name
            state["active"] = name
            return changed
        return Arm(activate, lambda r, seed: log.append(f"{name}{r}") or seconds,
                   lambda seed: log.append(f"warm-{name}"))

    policy = TimingPolicy(min_rounds=4, max_rounds=4)
    first = switching_pairs(arm("d", 1.0), arm("c", 0.5), [1], policy, first="candidate")
    log.clear()
    state["active"] = "c"
    again = switching_pairs(arm("d", 1.0), arm("c", 0.5), [1], settle_policy(policy, first), first="candidate",
                            prior=first)
    assert log == ["c4", "c5", "warm-d", "d4", "d5"]
    assert again["rounds"] == 6 and again["warmups"] == first["warmups"] + 1


def _record(name: str, ci: tuple[float, float], verdict: str = "no_stable_gain") -> dict:
    speed = {"speedup": (ci[0] + ci[1]) / 2, "ci95": list(ci), "rounds": 4, "stopped": "run_budget",
             "dense_median_s": 1.0, "candidate_median_s": 0.9}
    return {"name": name, "verdict": verdict, "speed": speed}


@pytest.mark.parametrize(("verdict", "ci", "extra", "expected"), [
    ("no_stable_gain", (1.0, 1.04), {}, True),  # straddles the threshold
    ("recommended", (1.025, 1.05), {}, True),  # clears it by less than the margin
    ("recommended", (1.2, 1.3), {}, False),
    ("no_stable_gain", (0.8, 0.9), {"dense_excess": 0.3}, False),  # slowed, but cannot reach the threshold
    # a cache that skipped nothing, against a dense arm 33.5 % slow (W17, H200): over the receipts' bound
    ("invalid_timing", (0.951, 1.424), {"dense_excess": 0.335}, True),
    ("recommended", (1.44, 1.46), {"dense_excess": 0.04}, False),  # deflated by 4 % it still clears 1.02
    ("recommended", (1.06, 1.08), {"dense_excess": 0.05}, True),  # deflated by 5 % it would not
    ("recommended", (1.06, 1.08), {"dense_excess": 0.01}, False),  # within the target: not slowed
    ("recommended", (1.06, 1.08), {"dense_excess": 0.05, "dense_floor_source": "run_reference"}, False),
    ("invalid_nonfinite", (1.0, 1.04), {}, False),
])
def test_which_verdicts_a_settling_pass_takes_up(verdict, ci, extra, expected) -> None:
    record = _record("x", ci, verdict)
    record["speed"].update(extra)
    assert unsettled(record, TimingPolicy(threshold=1.02)) is expected


def test_the_pass_retimes_only_unsettled_verdicts_and_charges_its_time_as_optional() -> None:
    clock = Clock()
    budget = RunBudget(100.0, tail_s=0.0, clock=clock)
    policy = TimingPolicy(threshold=1.02, run_budget=budget)
    records = [_record("clear", (1.2, 1.3), "recommended"), _record("straddles", (1.0, 1.04)),
               _record("thin", (1.021, 1.05), "recommended"), _record("slow", (0.8, 0.9)),
               {"name": "bad", "verdict": "invalid_nonfinite", "speed": _record("x", (1.0, 1.04))["speed"]}]
    seen = []

    def retime(record: dict) -> None:
        seen.append(record["name"])
        clock.now += 5.0
        record["speed"] = {**record["speed"], "ci95": [1.04, 1.05], "rounds": 8}
        record["verdict"] = "recommended"

    out = settle_pass(records, policy, retime, clock=clock)
    assert seen == out["candidates"] == ["straddles", "thin"] and out["refused"] == []
    assert out["seconds"] == 10.0 and budget.extended_s == 10.0
    before = records[1]["settle"]["before"]
    assert before["verdict"] == "no_stable_gain" and before["ci95"] == [1.0, 1.04] and before["rounds"] == 4
    assert "settle" not in records[0] and "settle" not in records[3]


def test_the_pass_takes_nothing_the_run_budget_does_not_have() -> None:
    clock = Clock()
    budget = RunBudget(100.0, tail_s=0.0, clock=clock)
    clock.now = 96.0  # 4 s left: one pass of a 1 s generation costs 6 s
    policy = TimingPolicy(threshold=1.02, run_budget=budget)
    records = [_record("a", (1.0, 1.04))]
    assert pass_price_s(records[0]["speed"]) == 6.0
    out = settle_pass(records, policy, lambda record: pytest.fail("no room"), clock=clock)
    assert out["refused"] == ["a"] and budget.cut == 1 and "settle" not in records[0]
    assert settle_pass(records, replace(policy, run_budget=None), lambda r: pytest.fail("no budget"))[
        "candidates"] == []


def test_a_pass_that_fails_keeps_the_first_pass_result() -> None:
    budget = RunBudget(100.0, tail_s=0.0, clock=Clock())
    records = [_record("a", (1.0, 1.04))]

    def retime(record: dict) -> None:
        raise RuntimeError("install refused")

    out = settle_pass(records, TimingPolicy(threshold=1.02, run_budget=budget), retime, clock=Clock())
    assert out["candidates"] == ["a"] and records[0]["verdict"] == "no_stable_gain"
    assert records[0]["settle"]["before"]["error"] == "RuntimeError: install refused"


def test_the_run_budget_keeps_a_candidate_s_price_for_the_settling_pass_until_it_starts() -> None:
    """Host waits and optional rounds cannot spend what the pass needs (at W17 on an H200 they spent all the slack
    and the pass was refused); the pass counts as one item in the fair shares; released, it is slack again."""
    clock = Clock()
    budget = RunBudget(100.0, tail_s=0.0, clock=clock)
    budget.plan(items=3, first_item_s=10.0, peers=0, settle=True)
    budget.start_item(0.0)  # 2 items to come and the pass: reserve 30 s, slack 70 s over the item, 2 items, pass
    assert budget.reserve_s() == pytest.approx(30.0) and budget.share_s() == pytest.approx(70.0 / 4)
    plain = RunBudget(100.0, tail_s=0.0, clock=Clock())
    plain.plan(items=3, first_item_s=10.0)
    plain.start_item(0.0)
    assert plain.reserve_s() == pytest.approx(20.0) and plain.share_s() == pytest.approx(80.0 / 3)
    clock.now = 10.0  # the item cost 10 s (a candidate's price stays 10 s)
    budget.end_item(0.0)
    budget.items_left = 0  # the other items are done
    clock.now = 75.0  # 25 s left, 10 of them kept for the pass
    assert budget.slack_s() == pytest.approx(15.0)
    records = [_record("a", (1.0, 1.04))]
    seen = []
    out = settle_pass(records, TimingPolicy(threshold=1.02, run_budget=budget),
                      lambda record: seen.append(budget.slack_s()), clock=clock)
    assert out["candidates"] == ["a"] and seen == [pytest.approx(25.0)] and budget.settle_shares == 0


def test_a_bench_run_settles_a_candidate_at_its_end(tmp_path: Path, monkeypatch) -> None:
    """On the tiny model, with a run budget: a candidate taken as unsettled is installed again after every row,
    its pair continues from its rounds (its dense arm still matching the dense pilot bit for bit), its verdict is
    decided again, the model is dense afterwards, and the report says what the pass did."""
    path = tiny_candidates(tmp_path)
    first_pass = {"a"}

    def forced(record, policy):  # 'a' is unsettled when its first pass ends, and settled after its second
        return record.get("name") in first_pass and "settle" not in record and record.get("speed") is not None

    monkeypatch.setattr(harness, "unsettled", forced)
    monkeypatch.setattr(settle, "unsettled", forced)
    out = tmp_path / "o"
    results = run_bench(BenchConfig(model="tiny-wan2.1", candidates=str(path), out=str(out), run_budget_s=600.0,
                                    max_noise_floor=1e3,
                                    progress=False), registry=exact_registry())
    a, b = results["candidates"]
    assert results["settle"]["candidates"] == ["a"] and b.get("settle", {}).get("reason") in (None, "width")
    assert ("settle" in b) == (results["settle"]["widened"] == ["b"])  # a CI left wide gets the width part
    before = a["settle"]["before"]
    assert a["speed"]["rounds"] >= before["rounds"] + SWITCH_BLOCK and a["timing_mismatch"] == []
    assert a["verdict"] in ("recommended", "no_stable_gain") and results["dense"]["stable_after_candidates"]
    assert results["wall_s"]["settle"] > 0 and results["run_budget"]["extended_s"] >= a["settle"]["seconds"]
    report = (out / "report.md").read_text()
    assert "settling pass" in report and f"{before['rounds']} rounds" in report


def test_the_settling_pass_comes_before_the_peers_and_keeps_their_price(tmp_path: Path, monkeypatch) -> None:
    """With peers and a row whose verdict is not settled: the pass runs after the rows and before the peers, while
    the run budget's reserve still holds the peer's mandatory price (the peers' optional rounds take what the pass
    leaves, not the other way round)."""
    path = tiny_candidates(tmp_path)

    def forced(record, policy):
        return record.get("name") == "a" and "settle" not in record and record.get("speed") is not None

    monkeypatch.setattr(harness, "unsettled", forced)
    monkeypatch.setattr(settle, "unsettled", forced)
    order: list[tuple[str, int]] = []
    settle_first, peers_first = harness._settle, harness._time_peers

    def settle_spy(results, cfile, pilots, runner, dense, config, *rest):
        order.append(("settle", config.extra["_timing_policy"].run_budget.peers_left))
        return settle_first(results, cfile, pilots, runner, dense, config, *rest)

    def peers_spy(results, *rest):
        order.append(("peers", len(results["candidates"])))
        return peers_first(results, *rest)

    monkeypatch.setattr(harness, "_settle", settle_spy)
    monkeypatch.setattr(harness, "_time_peers", peers_spy)
    results = run_bench(BenchConfig(model="tiny-wan2.1", candidates=str(path), out=str(tmp_path / "o"),
                                    run_budget_s=600.0, max_noise_floor=1e3, peers=["eager"], progress=False),
                        registry=exact_registry())
    assert order == [("settle", 1), ("peers", 2)]
    assert "a" in results["settle"]["candidates"] and results["peers"][0]["verdict"] == "peer_reference"
    assert results["dense"]["stable_after_candidates"]


@pytest.mark.parametrize("verdict, ci, target, expected", [
    ("no_stable_gain", (0.944, 1.004), 0.02, True),     # run V's mha-fused: 3.1 % after 5 rounds
    ("recommended", (1.437, 1.457), 0.02, False),
    ("recommended", (1.437, 1.457), 0.005, True),
    ("invalid_timing", (1.1, 1.4), 0.02, True),
    ("noisy_host", (0.9, 1.2), 0.02, False),             # no speed verdict to stand on it
    ("rejected_at_install", None, 0.02, False),
])
def test_which_rows_the_width_part_takes_up(verdict, ci, target, expected) -> None:
    record = _record("x", ci or (1.0, 1.0), verdict)
    if ci is None:
        record["speed"] = None
    assert wide(record, TimingPolicy(threshold=1.02, target_halfwidth=target)) is expected


def test_the_width_part_follows_the_verdicts_and_skips_rows_already_retimed() -> None:
    """Unsettled verdicts first, then the wide rows the first part did not take up, in order, each within the
    run budget, each marked with the reason; without ``widen`` there is no width part."""
    clock = Clock()
    budget = RunBudget(100.0, tail_s=0.0, clock=clock)
    policy = TimingPolicy(threshold=1.02, run_budget=budget)
    records = [_record("wide", (0.944, 1.004)), _record("straddles", (0.99, 1.06)),
               _record("narrow", (0.98, 0.99)), _record("wide2", (1.3, 1.5), "recommended")]
    order = []

    def run(tag: str):
        def go(record: dict, seconds: float | None = None) -> None:
            order.append((tag, record["name"]))
            clock.now += 5.0
        return go

    out = settle_pass(records, policy, run("verdict"), clock=clock, widen=run("width"))
    assert order == [("verdict", "straddles"), ("width", "wide"), ("width", "wide2")]
    assert out["candidates"] == ["straddles"] and out["widened"] == ["wide", "wide2"] and out["refused"] == []
    assert [r.get("settle", {}).get("reason") for r in records] == ["width", "verdict", None, "width"]
    assert out["seconds"] == 15.0 == budget.extended_s
    clock.now = 100.0 - 6.0 - 5.0  # an install, a warm generation and a block fit, the time budget does not
    late = [_record("wide", (0.944, 1.004))]
    out = settle_pass(late, replace(policy, budget_s=6.0), run("verdict"), clock=clock, widen=run("width"))
    assert out["refused"] == ["wide"] and "settle" not in late[0]
    plain = [_record("wide", (0.944, 1.004))]
    assert settle_pass(plain, policy, run("verdict"), clock=clock)["widened"] == [] and "settle" not in plain[0]


def test_a_width_pass_continues_the_pair_until_narrow() -> None:
    """:func:`width_policy`: one more block always, then rounds while the CI is wider than the target."""
    slow = [1.1, 1.0, 1.2, 1.05] + [1.0] * 40  # the dense arm in a slow phase in three of the first rounds
    rows = [(timed(q), timed(1.0)) for q in slow]
    first = run_rounds(lambda r: rows[r], TimingPolicy(min_rounds=4, max_rounds=4), clock=_clock(0.0))
    rules = width_policy(TimingPolicy(min_rounds=4, max_rounds=30, target_halfwidth=0.02, budget_s=1e9), first)
    assert rules.min_rounds == 4 + SWITCH_BLOCK and not rules.verdict_only and rules.width_pool is None
    more = run_rounds(lambda r: rows[r], rules, clock=_clock(0.0), prior=first)
    assert more["rounds"] >= 4 + SWITCH_BLOCK and more["stopped"] == "target"
    assert ci_halfwidth(more) <= 0.02 < ci_halfwidth(first)


def test_a_wide_row_takes_its_share_of_the_slack_never_less_than_its_time_budget() -> None:
    """Rows are done when the width part runs, so a wide row may time rounds for its share of the slack (split
    evenly over it and the wide rows after it), less the pass's fixed price; never less than its time budget
    (run B at W17: 84 s of the budget unused while ``fp8-ffn`` stopped at 2.4 % after its 6 s)."""
    clock = Clock()
    budget = RunBudget(100.0, tail_s=10.0, clock=clock)
    policy = TimingPolicy(threshold=1.02, run_budget=budget, budget_s=6.0)
    records = [_record("a", (0.90, 0.96)), _record("b", (1.3, 1.5), "recommended")]
    granted = {}

    def widen(record: dict, seconds: float) -> None:
        granted[record["name"]] = seconds
        clock.now += seconds + pass_price_s(record["speed"])

    out = settle_pass(records, policy, lambda r: pytest.fail("no verdict to settle"), clock=clock, widen=widen)
    fixed = pass_price_s(records[0]["speed"])
    assert out["widened"] == ["a", "b"] and out["refused"] == []
    assert granted["a"] == pytest.approx(90.0 / 2 - fixed)          # half the slack: one more wide row follows
    assert granted["b"] == pytest.approx(90.0 - 45.0 - fixed)       # the rest: the last wide row
    assert clock.now <= 100.0 - 10.0 + 1e-9                          # within the budget, its tail kept
    rules = width_policy(policy, records[0]["speed"] | {"rounds": 5}, budget_s=granted["a"])
    assert rules.budget_s == pytest.approx(granted["a"]) and rules.max_rounds == 5 + policy.max_rounds
    assert width_policy(policy, {"rounds": 5}, budget_s=1.0).budget_s == 6.0   # never below the time budget
    assert width_policy(policy, {"rounds": 5}).budget_s == 6.0
