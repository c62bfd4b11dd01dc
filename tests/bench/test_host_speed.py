"""The host-speed probe of the bench: the probe itself, the arms' split, the run summary, and the extension rule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.bench.host_speed import (
    SLOW_PHASE,
    describe,
    host_speed_summary,
    host_split,
    probe_ms,
    run_probes,
)
from worldfoundry.bench.timing import Timed, TimingPolicy, run_rounds


def _fake_clock(step: float):
    counter = itertools.count()
    return lambda: next(counter) * step


def test_probe_times_the_loop_with_the_given_clock() -> None:
    assert probe_ms(clock=_fake_clock(0.002)) == pytest.approx(2.0)
    assert probe_ms(100) > 0.0
    with pytest.raises(ValueError, match="loops: must be > 0, got 0"):
        probe_ms(0)


def test_split_is_the_ratio_of_the_arms_median_probes() -> None:
    assert host_split([1.0, 1.0, 9.0], [1.5, 1.5, 0.1]) == pytest.approx(0.5)
    assert host_split([2.0], [1.0]) == pytest.approx(-0.5)
    assert host_split([None, None], [1.0]) is None  # samples of a run without probes
    assert host_split([], []) is None


def test_summary_of_a_run_with_a_slow_phase() -> None:
    s = host_speed_summary([1.0, 1.1, 1.0, 1.8, None, 2.0])
    assert s["probes"] == 5 and s["min_ms"] == 1.0 and s["max_ms"] == 2.0 and s["spread"] == pytest.approx(2.0)
    assert s["slow_fraction"] == pytest.approx(2 / 5) and s["slow_phase"] == SLOW_PHASE
    assert host_speed_summary([None]) is None
    assert "40% of 5 timed generations ran in a slow phase" in describe(s)
    assert describe(None) == "not probed"


@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=50), scale=st.floats(0.1, 10.0))
def test_summary_is_scale_free_and_bounded(values, scale) -> None:
    a = host_speed_summary(values)
    b = host_speed_summary([v * scale for v in values])
    assert a["spread"] >= 1.0 and 0.0 <= a["slow_fraction"] < 1.0  # the fastest probe is never slow
    assert b["spread"] == pytest.approx(a["spread"], rel=1e-9)
    assert b["slow_fraction"] == a["slow_fraction"] or abs(b["slow_fraction"] - a["slow_fraction"]) <= 1 / len(values)


def test_run_probes_collects_control_candidates_and_peers() -> None:
    results = {"dense": {"control": {"host_probe_ms": {"dense": [1.0], "candidate": [1.1]}}},
               "candidates": [{"speed": {"host_probe_ms": {"dense": [1.2, None], "candidate": [1.3]}}},
                              {"speed": None}],
               "peers": [{"speed": {"host_probe_ms": {"dense": [2.0], "candidate": [2.1]}}}]}
    assert sorted(run_probes(results)) == [1.0, 1.1, 1.2, 1.3, 2.0, 2.1]
    assert run_probes({"candidates": []}) == []


def _pair(dense_host: float, cand_host: float):
    return Timed(0.1, (0.05, 0.05), 42, dense_host), Timed(0.08, (0.04, 0.04), 42, cand_host)


def test_a_candidate_whose_arms_ran_on_hosts_of_different_speed_gets_more_rounds() -> None:
    # the candidate's first three generations ran in a slow phase of the host (probe 1.5 ms against 1.0): its CI is
    # narrow, but the arms are not comparable until more rounds bring the medians together
    samples = [_pair(1.0, 1.5)] * 3 + [_pair(1.0, 1.0)] * 10
    policy = TimingPolicy(min_rounds=3, max_rounds=12, budget_s=100.0)
    out = run_rounds(lambda r: samples[r], policy, clock=_fake_clock(1.0))
    assert out["extended"] >= 1 and out["rounds"] > 3
    assert abs(out["host_split"]) <= policy.host_tolerance
    assert out["host_probe_ms"]["candidate"][:3] == [1.5, 1.5, 1.5]
    even = run_rounds(lambda r: _pair(1.0, 1.05), policy, clock=_fake_clock(1.0))
    assert even["rounds"] == 3 and even["extended"] == 0 and even["host_split"] == pytest.approx(0.05)


def test_a_split_that_never_closes_stops_at_the_extended_budget() -> None:
    policy = TimingPolicy(min_rounds=3, max_rounds=50, budget_s=4.0)
    out = run_rounds(lambda r: _pair(1.0, 2.0), policy, clock=_fake_clock(1.0))
    assert out["rounds"] == 10 and out["host_split"] == pytest.approx(1.0)


def test_unprobed_samples_are_never_extended_for_the_host() -> None:
    out = run_rounds(lambda r: (2.0, 1.0), TimingPolicy(min_rounds=3, max_rounds=10), clock=_fake_clock(0.0))
    assert out["rounds"] == 3 and out["host_split"] is None


def test_timed_reads_the_probe_from_the_phases() -> None:
    t = Timed.of(0.5, {"steps_s": [0.25, 0.25], "host_probe_ms": 1.25}, 7)
    assert t.host_ms == 1.25 and t.group == 7 and t.steps == (0.25, 0.25)
    assert Timed.of(0.5, {}, 7).host_ms is None


def test_policy_rejects_a_non_positive_host_tolerance() -> None:
    with pytest.raises(ValueError, match="host_tolerance: must be > 0"):
        TimingPolicy(host_tolerance=0.0)
