"""Request schedules for routed (multi-expert) denoisers, e.g. Wan2.2 A14B's high/low-noise experts.

A :class:`RequestSchedule` is immutable and prepared before the first model call of a request. It maps each
global step to its expert, the expert-local zero-based index and the expert's phase length, so per-expert
state (warm-up, final dense steps) is computed within the expert's own phase. A :class:`ScheduleTracker`
checks the calls of one request against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from worldfoundry.errors import RequestError


@dataclass(frozen=True)
class SchedulePhase:
    expert: str
    start: int
    length: int


@dataclass(frozen=True)
class StepPlacement:
    step_index: int
    timestep: float
    expert: str
    expert_step_index: int
    expert_phase_length: int


@dataclass(frozen=True)
class RequestSchedule:
    """Per global step: timestep and expert. Build with :meth:`from_steps`.

    Raises (from :meth:`from_steps`):
        RequestError: empty, non-finite or increasing timesteps, mismatched lengths, or an expert that
            appears again after another expert took over (the schedule must be monotonic high -> low noise).
    """

    timesteps: tuple[float, ...]
    experts: tuple[str, ...]
    phases: tuple[SchedulePhase, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.phases:  # built directly: validate and derive the phases like from_steps does
            built = RequestSchedule.from_steps(self.timesteps, self.experts)
            object.__setattr__(self, "timesteps", built.timesteps)
            object.__setattr__(self, "experts", built.experts)
            object.__setattr__(self, "phases", built.phases)

    @classmethod
    def from_steps(cls, timesteps: Sequence[Any], experts: Sequence[str]) -> RequestSchedule:
        ts = tuple(float(t) for t in timesteps)
        ex = tuple(str(e) for e in experts)
        if not ts:
            raise RequestError("schedule: no steps")
        if len(ts) != len(ex):
            raise RequestError(f"schedule: {len(ts)} timesteps but {len(ex)} expert labels")
        if any(not math.isfinite(t) for t in ts):
            raise RequestError("schedule: timesteps must be finite")
        for i in range(1, len(ts)):
            if ts[i] > ts[i - 1]:
                raise RequestError(
                    f"schedule: timesteps must not increase (step {i}: {ts[i]} > step {i - 1}: {ts[i - 1]})"
                )
        phases: list[SchedulePhase] = []
        for i, expert in enumerate(ex):
            if phases and phases[-1].expert == expert:
                last = phases[-1]
                phases[-1] = SchedulePhase(expert, last.start, last.length + 1)
                continue
            if any(p.expert == expert for p in phases):
                raise RequestError(
                    f"schedule: expert {expert!r} returns at step {i} after another expert; "
                    "the schedule must route high -> low noise monotonically"
                )
            phases.append(SchedulePhase(expert, i, 1))
        return cls(ts, ex, tuple(phases))

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    def phase_of(self, expert: str) -> SchedulePhase:
        for phase in self.phases:
            if phase.expert == expert:
                return phase
        raise RequestError(f"schedule: expert {expert!r} has no phase (experts: {[p.expert for p in self.phases]})")

    def locate(self, step_index: int) -> StepPlacement:
        if not 0 <= step_index < self.num_steps:
            raise RequestError(f"schedule: step {step_index} outside 0..{self.num_steps - 1}")
        expert = self.experts[step_index]
        phase = self.phase_of(expert)
        return StepPlacement(step_index, self.timesteps[step_index], expert, step_index - phase.start, phase.length)

    def to_json(self) -> dict[str, Any]:
        return {
            "timesteps": list(self.timesteps),
            "experts": list(self.experts),
            "phases": [{"expert": p.expert, "start": p.start, "length": p.length} for p in self.phases],
        }


class ScheduleTracker:
    """Checks the model calls of one request against its schedule.

    Each step may be called once per CFG branch, in order. Raises :class:`RequestError` for a timestep or
    expert that differs from the schedule, a duplicate call, an out-of-order call, or (in :meth:`finish`)
    an incomplete phase.

    With ``expert`` set, the tracker covers that expert's phase only (a per-expert component such as one
    expert's step cache): its first call must be the phase's first step and :meth:`finish` checks that phase.
    """

    def __init__(self, request_id: str, schedule: RequestSchedule, *, atol: float = 1e-4,
                 expert: str | None = None) -> None:
        self.request_id = request_id
        self.schedule = schedule
        self.atol = atol
        self.expert = expert
        self._steps = range(schedule.num_steps)
        if expert is not None:
            phase = schedule.phase_of(expert)
            self._steps = range(phase.start, phase.start + phase.length)
        self._last_step = self._steps.start - 1
        self._branches_at_step: set[str] = set()
        self._called_steps: set[int] = set()

    def check_call(self, step_index: int, timestep: float, expert: str, branch: str | None) -> StepPlacement:
        placement = self.schedule.locate(step_index)
        if self.expert is not None and placement.expert != self.expert:
            raise RequestError(
                f"request {self.request_id!r} step {step_index}: belongs to expert {placement.expert!r}'s phase, "
                f"not to {self.expert!r}'s (steps {self._steps.start}..{self._steps.stop - 1})"
            )
        if placement.expert != expert:
            raise RequestError(
                f"request {self.request_id!r} step {step_index}: expert {expert!r} called, schedule says "
                f"{placement.expert!r}"
            )
        if abs(float(timestep) - placement.timestep) > self.atol * max(1.0, abs(placement.timestep)):
            raise RequestError(
                f"request {self.request_id!r} step {step_index}: timestep {float(timestep)} differs from the "
                f"schedule's {placement.timestep}"
            )
        if step_index < self._last_step:
            raise RequestError(
                f"request {self.request_id!r}: step {step_index} called after step {self._last_step} (out of order)"
            )
        key = branch or "<single>"
        if step_index == self._last_step:
            if key in self._branches_at_step:
                raise RequestError(f"request {self.request_id!r}: step {step_index} branch {key!r} called twice")
        else:
            if step_index != self._last_step + 1:
                raise RequestError(
                    f"request {self.request_id!r}: step {step_index} called after step {self._last_step} "
                    "(steps must be consecutive)"
                )
            self._branches_at_step = set()
            self._last_step = step_index
        self._branches_at_step.add(key)
        self._called_steps.add(step_index)
        return placement

    def finish(self) -> None:
        missing = [i for i in self._steps if i not in self._called_steps]
        if missing:
            experts = sorted({self.schedule.experts[i] for i in missing})
            raise RequestError(
                f"request {self.request_id!r} ended with incomplete phase(s) for {experts}: "
                f"{len(missing)} step(s) never called (first: {missing[0]})"
            )
