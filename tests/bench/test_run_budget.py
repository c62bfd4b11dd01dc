"""The run budget: optional rounds and host waits stop where the rest of a run would no longer fit its deadline."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.bench import harness
from worldfoundry.bench.candidates import parse_candidates
from worldfoundry.bench.harness import BenchConfig, plan_bench, run_bench
from worldfoundry.bench.host_gate import CALIBRATION_CHECKS, PROBES_PER_CHECK, HostGate
from worldfoundry.bench.host_gate import describe as describe_gate
from worldfoundry.bench.run_budget import PEER_PRICE_FACTOR, RunBudget, describe
from worldfoundry.bench.timing import TimingPolicy, WidthPool, run_rounds
from worldfoundry.cli.main import main as cli_main
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.errors import BenchArgumentError, CandidateSchemaError


class Clock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_slack_is_the_deadline_minus_the_reserve_for_what_is_still_mandatory() -> None:
    clock = Clock()
    budget = RunBudget(100.0, tail_s=10.0, clock=clock)
    budget.plan(items=5, first_item_s=8.0)
    assert budget.reserve_s() == 5 * 8.0 + 10.0 and budget.slack_s() == 50.0
    budget.start_item(optional_s=0.0)  # the first item leaves the reserve while it runs
    assert budget.slack_s() == 58.0
    clock.now = 12.0
    budget.end_item(optional_s=3.0)  # 3 s of its 12 were optional (waits, width-pool rounds): it costs 9
    assert budget.costs == [9.0] and budget.item_s == 9.0
    assert budget.slack_s() == pytest.approx(100.0 - 12.0 - 4 * 9.0 - 10.0)
    clock.now = 90.0
    assert budget.slack_s() == 0.0 and not budget.allow() and budget.cut == 1
    report = budget.to_json()
    assert report["over_s"] == pytest.approx(90.0 + 4 * 9.0 + 10.0 - 100.0) and report["cut"] == 1
    assert "over by about 36 s" in describe(report) and "1 optional rounds or waits refused" in describe(report)
    assert "a candidate priced at 9.0 s, a peer at 13.5 s" in describe(report)
    assert describe(None).startswith("none")


def test_the_price_of_an_item_is_the_mean_of_those_finished() -> None:
    """The reserve stands for the sum of the items left: a slow item raises the price by its share (a median would
    ignore it, and the W17 runs priced that way overran their budget by 38-58 s)."""
    clock = Clock()
    budget = RunBudget(1000.0, clock=clock)
    budget.plan(items=4, first_item_s=1.0)
    for seconds in (10.0, 50.0, 12.0):
        budget.start_item()
        clock.now += seconds
        budget.end_item()
    assert budget.item_s == 24.0 and budget.items_left == 1


def test_peers_are_priced_apart_from_candidates() -> None:
    clock = Clock()
    budget = RunBudget(1000.0, tail_s=0.0, clock=clock)
    budget.plan(items=2, first_item_s=10.0, peers=2)
    # before any peer has run, a peer costs PEER_PRICE_FACTOR candidates (its warm-up comes on top of a row)
    assert budget.peer_s == PEER_PRICE_FACTOR * 10.0 and budget.reserve_s() == 2 * 10.0 + 2 * PEER_PRICE_FACTOR * 10.0
    budget.reprice(first_item_s=14.0)  # e.g. measured on the control pairs
    assert budget.item_s == 14.0 and budget.peer_s == PEER_PRICE_FACTOR * 14.0
    for kind, seconds in (("candidate", 12.0), ("candidate", 16.0), ("peer", 30.0)):
        budget.start_item(kind=kind)
        clock.now += seconds
        budget.end_item()
    assert budget.costs == [12.0, 16.0] and budget.peer_costs == [30.0]
    assert budget.item_s == 14.0 and budget.peer_s == 30.0  # a slow peer does not raise a candidate's price
    assert budget.items_left == 0 and budget.peers_left == 1 and budget.reserve_s() == 30.0
    report = budget.to_json()
    assert report["items_priced"] == 3 and report["peer_s"] == 30.0 and report["first_item_s"] == 14.0
    with pytest.raises(ValueError, match="kind must be one of candidate, peer, got 'row'"):
        budget.start_item(kind="row")
    with pytest.raises(ValueError, match="first_item_s >= 0"):
        budget.reprice(-1.0)


def test_a_row_is_priced_from_the_generations_it_needs() -> None:
    """Candidates go first after their pilot, so a row of four rounds is one pilot, eight timed generations and
    two warm-ups."""
    from worldfoundry.bench.run_pricing import row_generations

    assert row_generations(1, 4) == 11 and row_generations(2, 4) == 12 and row_generations(1, 5) == 14


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"seconds": 0.0}, "seconds must be > 0"),
    ({"seconds": float("nan")}, "seconds must be > 0"),
    ({"seconds": 10.0, "tail_s": -1.0}, "tail_s must be >= 0"),
])
def test_bad_budgets_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        RunBudget(**kwargs)
    with pytest.raises(ValueError, match="items >= 0"):
        RunBudget(10.0).plan(items=-1, first_item_s=1.0)
    with pytest.raises(ValueError, match="peers >= 0"):
        RunBudget(10.0).plan(items=1, first_item_s=1.0, peers=-1)
    with pytest.raises(RuntimeError, match="end_item without start_item"):
        RunBudget(10.0).end_item()


@settings(max_examples=80, deadline=None)
@given(seconds=st.floats(1.0, 1e4), items=st.integers(0, 50), peers=st.integers(0, 5), first=st.floats(0.0, 100.0),
       steps=st.lists(st.tuples(st.floats(0.0, 50.0), st.floats(0.0, 20.0), st.sampled_from(["candidate", "peer"])),
                      max_size=30))
def test_slack_is_never_negative_and_never_more_than_the_time_left(seconds, items, peers, first, steps) -> None:
    clock = Clock()
    budget = RunBudget(seconds, clock=clock)
    budget.plan(items=items, first_item_s=first, peers=peers)
    optional = 0.0
    for duration, extra, kind in steps:
        budget.start_item(optional, kind)
        clock.now += duration
        optional += min(extra, duration)
        budget.end_item(optional)
        slack = budget.slack_s()
        assert 0.0 <= slack <= max(0.0, seconds - clock.now)
        assert budget.items_left >= 0 and budget.peers_left >= 0
        assert all(cost >= 0 for cost in budget.costs + budget.peer_costs)


def test_a_round_longer_than_the_slack_is_not_started() -> None:
    clock = Clock()
    budget = RunBudget(100.0, tail_s=0.0, clock=clock)
    clock.now = 97.0
    assert budget.allow(2.0) and not budget.allow(4.0) and budget.cut == 1


def test_time_that_decides_no_verdict_is_held_to_the_items_fair_share() -> None:
    """A round that only narrows a decided CI, or a host wait, may use the current item's share of the slack (the
    slack split between it and the items still to come); a round that decides a verdict may use all of it."""
    clock = Clock()
    budget = RunBudget(100.0, tail_s=0.0, clock=clock)
    budget.plan(items=4, first_item_s=10.0, peers=1)
    budget.start_item(0.0)  # 3 candidates and 1 peer (15 s) still to come: reserve 45 s, slack 55 s
    assert budget.slack_s() == pytest.approx(55.0) and budget.share_s() == pytest.approx(11.0)
    # the share it was given at its start leaves out its own 10 s: (55 - 10) / 5
    assert budget.item_share_s == pytest.approx(9.0) and budget.fair_room_s() == pytest.approx(9.0)
    assert budget.allow(9.0, fair=True) and not budget.allow(9.5, fair=True) and budget.cut == 1
    budget.charge_fair(6.0)  # a fair round took 6 s: 3 s of its share are left, whatever the slack says
    assert budget.fair_room_s() == pytest.approx(3.0) and not budget.allow(4.0, fair=True) and budget.cut == 2
    assert budget.allow(50.0) and budget.cut == 2  # a round that decides a verdict may use the whole slack
    clock.now = 10.0
    budget.end_item(0.0)
    clock.now = 95.0  # 2 candidates and the peer still need 35 s: nothing optional is left, fair or not
    budget.start_item(0.0)
    assert budget.share_s() == 0.0 and not budget.allow(0.0, fair=True) and budget.cut == 3
    budget.end_item(0.0)
    assert budget.item_share_s is None


def test_a_width_round_past_its_share_is_refused_while_the_verdict_round_is_not() -> None:
    wide = _wide_pairs()
    budget = RunBudget(30.0, started=0.0, tail_s=0.0, clock=lambda: 0.0)
    budget.plan(items=10, first_item_s=2.0)
    budget.start_item(0.0)  # 9 items of 2 s still to come: slack 12 s, share 1.2 s; a round takes 2 s
    policy = TimingPolicy(min_rounds=3, max_rounds=30, budget_s=4.0, threshold=1.02, estimator="paired_median",
                          width_pool=WidthPool(1e9), run_budget=budget)
    counter = itertools.count()
    out = run_rounds(lambda r: wide[r], policy, clock=lambda: 2.0 * next(counter))
    assert out["stopped"] == "run_budget" and out["widened"] == 0 and budget.cut == 1


def test_width_rounds_stop_at_the_share_the_item_was_given() -> None:
    """The slack seen round by round stays large here (the run budget's clock stands still), so only the share
    fixed at the item's start, which the width rounds' time is charged to, ends them."""
    budget = RunBudget(30.0, started=0.0, tail_s=0.0, clock=lambda: 0.0)
    budget.plan(items=2, first_item_s=10.0)
    budget.start_item(0.0)  # 1 item of 10 s to come: slack 20 s, its share (20 - 10) / 2 = 5 s
    policy = TimingPolicy(min_rounds=3, max_rounds=30, budget_s=4.0, threshold=1.02, estimator="paired_median",
                          width_pool=WidthPool(1e9), run_budget=budget)
    counter = itertools.count()
    out = run_rounds(lambda r: _wide_pairs()[r], policy, clock=lambda: float(next(counter)))
    assert out["widened"] >= 1 and out["stopped"] == "run_budget" and out["rounds"] < 30
    assert budget.item_fair_s <= 5.0 + 3.0 and budget.share_s() == pytest.approx(10.0)


def test_rounds_past_the_budget_are_charged_to_the_run_budget_not_to_the_item() -> None:
    """An undecided candidate's extra rounds are optional time: counted in ``extended_s``, so the price of an item
    (what the reserve assumes for the items not yet run) stays its mandatory part."""
    noisy = [(1.0, 1 / 0.9), (1.0, 1 / 1.2)] * 20  # straddles 1.02 for as long as the rounds go on
    budget = RunBudget(1e6, started=0.0, tail_s=0.0, clock=lambda: 0.0)
    policy = TimingPolicy(min_rounds=3, max_rounds=30, budget_s=4.0, estimator="paired_median", threshold=1.02,
                          run_budget=budget)
    out = run_rounds(lambda r: noisy[r], policy, clock=itertools.count().__next__)
    assert out["extended"] > 0 and out["widened"] == 0
    assert budget.extended_s > 0 and budget.cut == 0


def _wide_pairs():
    return [(1.0, 0.5), (1.0, 0.45)] * 20  # clearly faster, CI about 5 % wide: the width pool would extend it


def test_a_width_pool_round_the_run_cannot_afford_is_not_added() -> None:
    counter = itertools.count()
    fake = lambda: float(next(counter))  # noqa: E731 - one second per reading
    policy = TimingPolicy(min_rounds=3, max_rounds=30, budget_s=4.0, threshold=1.02, estimator="paired_median",
                          width_pool=WidthPool(1e9))
    roomy = run_rounds(lambda r: _wide_pairs()[r], policy, clock=fake)
    assert roomy["widened"] > 0
    budget = RunBudget(1.0, started=0.0, tail_s=0.0, clock=lambda: 5.0)  # past the deadline: nothing optional left
    tight = run_rounds(lambda r: _wide_pairs()[r], TimingPolicy(**{**policy.__dict__, "run_budget": budget}),
                       clock=itertools.count().__next__)
    assert tight["stopped"] == "run_budget" and tight["widened"] == 0 and tight["rounds"] < roomy["rounds"]
    assert budget.cut == 1


def test_an_undecided_extension_also_stops_at_the_deadline() -> None:
    noisy = [(1.0, 1 / 0.9), (1.0, 1 / 1.2)] * 20  # straddles 1.02 for as long as the rounds go on
    base = TimingPolicy(min_rounds=3, max_rounds=30, budget_s=4.0, estimator="paired_median", threshold=1.02)
    extended = run_rounds(lambda r: noisy[r], base, clock=itertools.count().__next__)
    budget = RunBudget(1.0, started=0.0, tail_s=0.0, clock=lambda: 5.0)
    cut = run_rounds(lambda r: noisy[r], TimingPolicy(**{**base.__dict__, "run_budget": budget}),
                     clock=itertools.count().__next__)
    assert extended["extended"] > 0 and cut["extended"] == 0 and cut["stopped"] == "run_budget"


def test_the_host_gate_waits_only_while_the_run_budget_leaves_slack() -> None:
    now = [0.0]
    probes = iter([1.0] * CALIBRATION_CHECKS * PROBES_PER_CHECK)

    def probe() -> float:
        return next(probes, 2.0)  # slow after calibration

    def sleep(seconds: float) -> None:
        now[0] += seconds

    gate = HostGate(budget_s=60.0, max_wait_s=3.0, probe=probe, sleep=sleep, clock=lambda: now[0])
    gate.limit = lambda: 0.2
    gate.wait()
    report = gate.to_json()
    assert report["gave_up"] == report["limited"] == 1 and 0.2 <= report["waited_s"] < 0.3
    assert "1 of them cut short by the run budget" in describe_gate(report)
    gate.limit = lambda: 100.0  # a roomy budget: the gate's own limits bind (here the host becomes the reference)
    gate.wait()
    assert gate.to_json()["limited"] == 1 and gate.to_json()["waited_s"] > 0.3


def _registry() -> AccelerationRegistry:
    from tests.bench.test_harness import _scale_factory

    reg = AccelerationRegistry(discover=False)
    reg.register("exact_test", _scale_factory("exact_test", exact=True))
    return reg


def _data(**timing) -> dict:
    return {"workload": {"prompt": "a red square", "frames": 5, "height": 32, "width": 32, "steps": 2,
                         "guidance": 5.0, "seeds": [1]}, "timing": timing,
            "candidates": [{"name": "a", "accelerations": {"exact_test": {}}},
                           {"name": "b", "accelerations": {"exact_test": {}}}]}


def test_the_file_s_run_budget_applies_unless_the_command_line_sets_it() -> None:
    registry = _registry()
    cfile = parse_candidates(_data(run_budget_s=280), registry=registry)
    assert cfile.run_budget_s == 280.0
    assert harness.with_file_timing(BenchConfig(), cfile).run_budget_s == 280.0
    assert harness.with_file_timing(BenchConfig(run_budget_s=30.0), cfile).run_budget_s == 30.0
    assert harness.with_file_timing(BenchConfig(), parse_candidates(_data(), registry=registry)).run_budget_s is None
    for bad in (0, -5, "soon"):
        with pytest.raises(CandidateSchemaError, match="timing.run_budget_s"):
            parse_candidates(_data(run_budget_s=bad), registry=registry)


def test_a_bad_run_budget_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_data()))
    with pytest.raises(BenchArgumentError, match="--run-budget"):
        plan_bench(BenchConfig(model="tiny-wan2.1", candidates=str(path), run_budget_s=-1.0),
                   registry=_registry())


def test_the_cli_refuses_a_bad_run_budget_in_one_line(tmp_path: Path, capsys) -> None:
    rc = cli_main(["bench", "--run-budget", "0", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--run-budget" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_run_over_its_budget_still_runs_every_candidate_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_data(time_budget_s=0.5)))
    out = tmp_path / "o"
    results = run_bench(BenchConfig(model="tiny-wan2.1", candidates=str(path), out=str(out), run_budget_s=0.01,
                                    progress=False), registry=_registry())
    assert [c["verdict"] != "rejected_at_install" for c in results["candidates"]] == [True, True]
    assert all(c["speed"]["rounds"] >= 3 for c in results["candidates"])  # the mandatory rounds still ran
    report = results["run_budget"]
    assert report["seconds"] == 0.01 and report["over_s"] > 0 and report["items_priced"] == 2
    assert "- run budget: 0 s;" in (out / "report.md").read_text()
    plain = run_bench(BenchConfig(model="tiny-wan2.1", candidates=str(path), out=str(tmp_path / "p"),
                                  progress=False), registry=_registry())
    assert plain["run_budget"] is None


def test_a_row_is_repriced_from_the_control_generations_only() -> None:
    """The dense pilots (first calls, decoding) are left out: the price is the control pairs' mean generation wall,
    host waits subtracted, times the generations of a row."""
    import time
    from types import SimpleNamespace

    from worldfoundry.bench.run_pricing import reprice_rows, row_generations

    budget = RunBudget(1000.0)
    budget.plan(items=3, first_item_s=12.0)
    gate = SimpleNamespace(waited_s=7.0)
    runner = SimpleNamespace(counter=12, host_gate=gate)
    since = (time.perf_counter() - 15.0, 2, 2.0)  # 10 generations in 15 s, 5 s of them host waits
    reprice_rows(budget, runner, since, TimingPolicy(min_rounds=4), n_seeds=1)
    assert budget.first_item_s == pytest.approx(1.0 * row_generations(1, 4), rel=0.05)
    reprice_rows(budget, SimpleNamespace(counter=2, host_gate=None), (0.0, 2, 0.0), TimingPolicy(), n_seeds=1)
    assert budget.first_item_s == pytest.approx(11.0, rel=0.05)  # no generation since the mark: unchanged
    reprice_rows(None, runner, since, TimingPolicy(), n_seeds=1)  # no run budget: nothing to price
