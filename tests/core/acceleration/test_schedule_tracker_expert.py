"""``ScheduleTracker(expert=...)``: one expert's phase of a routed schedule."""

from __future__ import annotations

import pytest

from worldfoundry.core.acceleration.schedule import RequestSchedule, ScheduleTracker
from worldfoundry.errors import RequestError

SCHEDULE = RequestSchedule.from_steps([900.0, 700.0, 500.0, 300.0, 100.0], ["high", "high", "low", "low", "low"])


def test_low_expert_tracker_starts_at_its_phase_and_finishes_it():
    tracker = ScheduleTracker("r", SCHEDULE, expert="low")
    for step in (2, 3, 4):
        for branch in ("cond", "uncond"):
            placement = tracker.check_call(step, SCHEDULE.timesteps[step], "low", branch)
            assert placement.expert_step_index == step - 2 and placement.expert_phase_length == 3
    tracker.finish()


def test_expert_tracker_rejects_other_phases_and_late_starts():
    tracker = ScheduleTracker("r", SCHEDULE, expert="low")
    with pytest.raises(RequestError, match="belongs to expert 'high'"):
        tracker.check_call(1, 700.0, "high", "cond")
    with pytest.raises(RequestError, match="consecutive"):
        tracker.check_call(3, 300.0, "low", "cond")


def test_expert_tracker_finish_checks_only_its_phase():
    high = ScheduleTracker("r", SCHEDULE, expert="high")
    high.check_call(0, 900.0, "high", None)
    with pytest.raises(RequestError, match=r"incomplete phase\(s\) for \['high'\]: 1 step"):
        high.finish()
    high.check_call(1, 700.0, "high", None)
    high.finish()


def test_unknown_expert_is_an_error():
    with pytest.raises(RequestError, match="has no phase"):
        ScheduleTracker("r", SCHEDULE, expert="mid")
