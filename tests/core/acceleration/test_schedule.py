"""RequestSchedule / ScheduleTracker: monotonic expert routing, expert-local indices, strict call checking."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.schedule import RequestSchedule, ScheduleTracker
from worldfoundry.errors import RequestError

TIMESTEPS = [999.0, 800.0, 600.0, 400.0, 200.0, 50.0]
EXPERTS = ["high", "high", "high", "low", "low", "low"]


def test_locate_gives_expert_local_indices():
    schedule = RequestSchedule.from_steps(TIMESTEPS, EXPERTS)
    assert [(p.expert, p.start, p.length) for p in schedule.phases] == [("high", 0, 3), ("low", 3, 3)]
    placement = schedule.locate(3)
    assert (placement.expert, placement.expert_step_index, placement.expert_phase_length) == ("low", 0, 3)
    assert placement.timestep == 400.0
    assert schedule.to_json()["phases"][1] == {"expert": "low", "start": 3, "length": 3}
    with pytest.raises(RequestError, match="outside 0..5"):
        schedule.locate(6)
    with pytest.raises(RequestError, match="no phase"):
        schedule.phase_of("medium")


@pytest.mark.parametrize(("timesteps", "experts", "message"), [
    ([], [], "no steps"),
    ([3.0, 2.0], ["a"], "2 timesteps but 1 expert"),
    ([3.0, math.nan], ["a", "a"], "finite"),
    ([3.0, 4.0], ["a", "a"], r"must not increase \(step 1"),
    ([4.0, 3.0, 2.0], ["high", "low", "high"], "'high' returns at step 2"),
])
def test_invalid_schedules(timesteps, experts, message):
    with pytest.raises(RequestError, match=message):
        RequestSchedule.from_steps(timesteps, experts)


def test_direct_construction_is_validated_too():
    schedule = RequestSchedule((3.0, 2.0), ("a", "b"))
    assert schedule.locate(1).expert_step_index == 0
    with pytest.raises(RequestError, match="returns"):
        RequestSchedule((3.0, 2.0, 1.0), ("a", "b", "a"))


def _complete(tracker: ScheduleTracker, schedule: RequestSchedule, branches=("cond", "uncond")) -> None:
    for i in range(schedule.num_steps):
        for branch in branches:
            tracker.check_call(i, schedule.timesteps[i], schedule.experts[i], branch)


def test_tracker_accepts_a_complete_request():
    schedule = RequestSchedule.from_steps(TIMESTEPS, EXPERTS)
    tracker = ScheduleTracker("r1", schedule)
    _complete(tracker, schedule)
    tracker.finish()
    single = ScheduleTracker("r2", schedule)
    _complete(single, schedule, branches=(None,))
    single.finish()


def test_tracker_errors():
    schedule = RequestSchedule.from_steps(TIMESTEPS, EXPERTS)
    tracker = ScheduleTracker("r1", schedule)
    with pytest.raises(RequestError, match="expert 'low' called, schedule says 'high'"):
        tracker.check_call(0, 999.0, "low", "cond")
    with pytest.raises(RequestError, match="timestep 998.0 differs"):
        tracker.check_call(0, 998.0, "high", "cond")
    tracker.check_call(0, 999.0, "high", "cond")
    with pytest.raises(RequestError, match="branch 'cond' called twice"):
        tracker.check_call(0, 999.0, "high", "cond")
    tracker.check_call(0, 999.0, "high", "uncond")
    with pytest.raises(RequestError, match="consecutive"):
        tracker.check_call(2, 600.0, "high", "cond")
    tracker.check_call(1, 800.0, "high", "cond")
    with pytest.raises(RequestError, match="out of order"):
        tracker.check_call(0, 999.0, "high", "cond")
    with pytest.raises(RequestError, match=r"incomplete phase\(s\) for \['high', 'low'\].*first: 2"):
        tracker.finish()
    tracker.check_call(1, 800.0 + 1e-3, "high", "uncond")  # within the relative tolerance


@st.composite
def schedules(draw):
    n = draw(st.integers(1, 12))
    raw = draw(st.lists(st.floats(0, 1000, allow_nan=False), min_size=n, max_size=n))
    timesteps = sorted(raw, reverse=True)
    k = draw(st.integers(1, min(3, n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    experts = []
    for j in range(len(bounds) - 1):
        experts += [f"e{j}"] * (bounds[j + 1] - bounds[j])
    return timesteps, experts


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_locate_is_consistent_for_every_valid_schedule(data):
    timesteps, experts = data
    schedule = RequestSchedule.from_steps(timesteps, experts)
    assert sum(p.length for p in schedule.phases) == schedule.num_steps
    seen: dict[str, list[int]] = {}
    for i in range(schedule.num_steps):
        placement = schedule.locate(i)
        assert placement.expert == experts[i] and placement.timestep == timesteps[i]
        phase = schedule.phase_of(placement.expert)
        assert phase.start + placement.expert_step_index == i
        assert placement.expert_phase_length == phase.length == experts.count(placement.expert)
        seen.setdefault(placement.expert, []).append(placement.expert_step_index)
    for indices in seen.values():
        assert indices == list(range(len(indices)))  # each expert counts 0, 1, 2, ... within its own phase
    tracker = ScheduleTracker("r", schedule)
    _complete(tracker, schedule)
    tracker.finish()
