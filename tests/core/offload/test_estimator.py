"""Estimator maths: r from the two-slot schedule (default) or (N − r)·d ≤ N·c, evenly spread indices (property tests)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry_resident_blocks.residency_files import (
    CONFIG_FILENAME,
    REPORT_JSON_FILENAME,
    REPORT_MD_FILENAME,
    write_estimate,
)

from worldfoundry.core.offload.estimator import (
    RULES,
    estimate_residency,
    resident_count,
    resident_for_rule,
    resident_without_waits,
    two_slot_copy_wait_ms,
    uniform_resident_indices,
)

times = st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=1, max_value=200), c=times, d=times)
def test_r_is_the_smallest_count_meeting_the_budget(n: int, c: float, d: float) -> None:
    r = resident_count(n, c, d)
    assert 0 <= r <= n
    assert (n - r) * d <= n * c or r == n
    if r > 0:
        assert (n - (r - 1)) * d > n * c  # one fewer would break the budget
    if d <= c:
        assert r == 0


@settings(max_examples=40, deadline=None)
@given(n=st.integers(min_value=1, max_value=120), c=st.floats(min_value=1e-3, max_value=100.0),
       ratio=st.floats(min_value=1.0, max_value=50.0))
def test_r_grows_with_transfer_time(n: int, c: float, ratio: float) -> None:
    assert resident_count(n, c, c * ratio) <= resident_count(n, c, c * ratio * 1.5)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=1, max_value=200), c=times, d=times,
       u=st.floats(min_value=0.05, max_value=1.0, allow_nan=False))
def test_copy_utilisation_scales_the_budget_and_only_adds_residents(n: int, c: float, d: float, u: float) -> None:
    r = resident_count(n, c, d, copy_utilisation=u)
    assert 0 <= r <= n
    assert (n - r) * d <= n * (c * u) or r == n
    if r > 0:
        assert (n - (r - 1)) * d > n * (c * u)
    assert r >= resident_count(n, c, d)  # a smaller share never keeps fewer blocks resident
    assert resident_count(n, c, d, copy_utilisation=1.0) == resident_count(n, c, d)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_uniform_indices_are_evenly_spread(data) -> None:
    n = data.draw(st.integers(min_value=0, max_value=300))
    r = data.draw(st.integers(min_value=0, max_value=n))
    idx = uniform_resident_indices(n, r)
    assert len(idx) == r and len(set(idx)) == r and idx == sorted(idx)
    assert all(0 <= i < n for i in idx)
    if r:
        assert idx[0] == 0
        gaps = [b - a for a, b in zip(idx, idx[1:])] + [n - idx[-1] + idx[0]]  # wrap to the next forward
        assert max(gaps) - min(gaps) <= 1
        assert sum(gaps) == n
    if r == n:
        assert idx == list(range(n))


def test_known_values() -> None:
    assert resident_count(30, 1.27, 1.8) == 9  # Wan-1.3B W17-like: d > c
    assert resident_count(30, 1.27, 1.68, copy_utilisation=0.85) == 11  # with slack for the two-slot pipeline
    assert resident_count(50, 37.0, 23.4) == 0  # MiniMax-H3 at 16,384 rows: d < c
    assert resident_count(4, 0.0, 1.0) == 4
    assert resident_count(4, 1.0, 0.0) == 0
    assert resident_count(10, 1.0, 2.0) == 5  # exactly on the boundary: (10 − 5)·2 = 10·1
    assert uniform_resident_indices(10, 3) == [0, 3, 6]
    assert uniform_resident_indices(5, 0) == []


@pytest.mark.parametrize("bad", [(0, 1.0, 1.0), (3, -1.0, 1.0), (3, 1.0, float("nan")), (3, float("inf"), 1.0),
                                 (True, 1.0, 1.0)])
def test_resident_count_rejects_bad_input(bad) -> None:
    with pytest.raises(ValueError):
        resident_count(*bad)


@pytest.mark.parametrize("u", [0.0, -0.5, 1.5, float("nan"), True])
def test_copy_utilisation_outside_the_unit_interval_is_rejected(u) -> None:
    with pytest.raises(ValueError, match="copy_utilisation"):
        resident_count(30, 1.0, 2.0, copy_utilisation=u)


@pytest.mark.parametrize("n, r", [(-1, 0), (3, 4), (3, -1), (True, 0), (3, 1.0)])
def test_uniform_indices_reject_bad_input(n, r) -> None:
    with pytest.raises(ValueError):
        uniform_resident_indices(n, r)


def test_estimate_config_and_report(tmp_path) -> None:
    est = estimate_residency(30, 1.27, 1.8, contiguous=True, context={"device": "cuda:0", "dtype": "bfloat16"})
    assert est.rule == "schedule" and est.resident == 10 and est.streamed == 20  # the default rule
    assert est.indices == tuple(uniform_resident_indices(30, 10))
    paths = write_estimate(est, tmp_path / "out")
    assert {p.name for p in paths.values()} == {CONFIG_FILENAME, REPORT_JSON_FILENAME, REPORT_MD_FILENAME}
    config = json.loads(paths["config"].read_text())
    assert config == {"offload_resident_blocks": 10, "cpu_offload_block_contiguous": True,
                      "resident_block_indices": list(est.indices), "num_blocks": 30,
                      "estimate": {"rule": "schedule", "num_blocks": 30, "compute_ms": 1.27, "transfer_ms": 1.8,
                                   "copy_utilisation": 1.0, "schedule_resident": 10,
                                   "schedule_predicted_copy_wait_ms": 0.0, "budget_resident": 9,
                                   "budget_predicted_copy_wait_ms": 1.59}}
    report = json.loads(paths["report_json"].read_text())
    assert report["compute_ms"] == 1.27 and report["transfer_ms"] == 1.8 and report["layout"] == "contiguous"
    assert report["device"] == "cuda:0" and "re-estimate" in report["note"]
    assert report["rule"] == "schedule" and report["rules"]["budget_resident"] == 9
    markdown = paths["report_md"].read_text()
    assert "r = **10** of N = 30" in markdown and "re-estimate" in markdown
    assert "| schedule (used) | 10 | 0.0 |" in markdown and "| budget | 9 | 1.59 |" in markdown


def test_budget_rule_stays_available(tmp_path) -> None:
    est = estimate_residency(30, 1.27, 1.8, contiguous=True, rule="budget")
    assert est.resident == 9 and est.streamed == 21 and est.copy_need_ms <= est.copy_budget_ms
    config = json.loads(write_estimate(est, tmp_path)["config"].read_text())
    assert config["offload_resident_blocks"] == 9 and config["estimate"]["rule"] == "budget"
    assert config["estimate"]["schedule_resident"] == 10


def test_report_states_the_copy_utilisation(tmp_path) -> None:
    est = estimate_residency(30, 1.27, 1.68, contiguous=True, copy_utilisation=0.85, rule="budget")
    assert est.resident == 11 and est.copy_need_ms <= est.copy_budget_ms
    report = json.loads(write_estimate(est, tmp_path)["report_json"].read_text())
    assert report["copy_utilisation"] == 0.85 and "0.85 * c" in report["rule_text"]
    schedule = estimate_residency(30, 1.27, 1.68, contiguous=True, copy_utilisation=0.85)
    assert schedule.resident == resident_without_waits(30, 1.27 * 0.85, 1.68)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=1, max_value=60), c=st.floats(min_value=0.0, max_value=10.0),
       ratio=st.floats(min_value=0.0, max_value=6.0), u=st.floats(min_value=0.05, max_value=1.0),
       rule=st.sampled_from(RULES))
def test_both_rules_keep_r_in_range_and_zero_when_copies_hide(n: int, c: float, ratio: float, u: float,
                                                               rule: str) -> None:
    d = c * ratio
    r = resident_for_rule(n, c, d, rule=rule, copy_utilisation=u)
    assert 0 <= r <= n
    if d <= c * u:
        assert r == 0  # every copy hides behind one block's compute
    if rule == "schedule":
        assert two_slot_copy_wait_ms(n, c * u, d, uniform_resident_indices(n, r)) == 0.0
    else:
        assert r == resident_count(n, c, d, copy_utilisation=u)


def test_unknown_rule_is_rejected() -> None:
    with pytest.raises(ValueError, match="rule"):
        resident_for_rule(30, 1.0, 2.0, rule="fastest")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=1, max_value=60), c=st.floats(min_value=0.01, max_value=10.0),
       ratio=st.floats(min_value=0.0, max_value=4.0), data=st.data())
def test_two_slot_schedule_predictions(n: int, c: float, ratio: float, data) -> None:
    d = c * ratio
    r = data.draw(st.integers(min_value=0, max_value=n))
    wait = two_slot_copy_wait_ms(n, c, d, uniform_resident_indices(n, r))
    assert wait >= 0.0
    if d <= c or r == n:
        assert wait == 0.0  # each copy hides behind one block's compute
    # never less than what the total budget alone forces: the copies need (n - r) * d of copy-stream time
    assert wait >= (n - r - 2) * d - n * c - 1e-6
    r_free = resident_without_waits(n, c, d)
    assert two_slot_copy_wait_ms(n, c, d, uniform_resident_indices(n, r_free)) == 0.0
    if r_free > 0:
        assert two_slot_copy_wait_ms(n, c, d, uniform_resident_indices(n, r_free - 1)) > 0.0
    if d <= c:
        assert r_free == 0


def test_two_slot_known_values() -> None:
    # W17 on the H200: the rule gives r = 8 and leaves runs of three streamed blocks, each waiting d - c
    assert round(two_slot_copy_wait_ms(30, 1.27, 1.68, uniform_resident_indices(30, 8)), 2) == 2.46
    assert resident_without_waits(30, 1.27, 1.68) == 10
    assert resident_without_waits(50, 37.0, 23.4) == 0  # MiniMax-H3 at 16,384 rows
    report = estimate_residency(30, 1.27, 1.68, contiguous=True, rule="budget").to_report()
    assert report["two_slot_resident_without_waits"] == 10
    assert report["two_slot_predicted_copy_wait_ms_per_forward"] > 2.0  # what the budget rule leaves
    default = estimate_residency(30, 1.27, 1.68, contiguous=True).to_report()
    assert default["resident"] == 10 and default["two_slot_predicted_copy_wait_ms_per_forward"] == 0.0
