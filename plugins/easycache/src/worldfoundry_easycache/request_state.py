"""Per-request state of one EasyCache handle (one expert): call admission, per-branch caches, receipts.

A request's state lives from ``begin_request`` to ``end_request``. Every tensor it holds sits in a branch's
:class:`~worldfoundry.core.acceleration.caching.TransformationCache` or conditioning snapshot and is dropped by
:meth:`RequestState.release`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from worldfoundry.core.acceleration.caching import (
    ConditionSnapshot,
    TransformationCache,
)
from worldfoundry.core.acceleration.schedule import RequestSchedule, ScheduleTracker
from worldfoundry.plugin import RequestContext, RequestError
from worldfoundry_easycache.options import PLUGIN_NAME

BRANCHES: Final = ("cond", "uncond")
#: Branch key used when the context carries no CFG branch (guidance off).
SINGLE_BRANCH: Final = "single"
#: Longest per-branch decision pattern kept in the receipt ("C" computed, "S" skipped).
MAX_PATTERN: Final = 512


@dataclass
class BranchRecord:
    """One CFG branch of one request on one expert."""

    cache: TransformationCache
    snapshot: ConditionSnapshot | None = None
    rebuild: Callable[[torch.Tensor], Any] | None = None
    out_dtype: torch.dtype | None = None
    uncacheable: str | None = None
    last_local: int | None = None
    computed: int = 0
    skipped: int = 0
    invalidations: int = 0
    pattern: list[str] = field(default_factory=list)

    def mark(self, skipped: bool) -> None:
        if skipped:
            self.skipped += 1
        else:
            self.computed += 1
        if len(self.pattern) < MAX_PATTERN:
            self.pattern.append("S" if skipped else "C")

    def invalidate(self) -> None:
        self.cache.clear()
        self.snapshot = None
        self.invalidations += 1

    def tensors(self) -> list[torch.Tensor]:
        held = self.cache.tensors()
        if self.snapshot is not None:
            held.extend(self.snapshot.tensors())
        return held

    def release(self) -> None:
        self.cache.clear()
        self.snapshot = None
        self.rebuild = None

    def to_json(self) -> dict[str, Any]:
        return {
            "computed": self.computed,
            "skipped": self.skipped,
            "invalidations": self.invalidations,
            "pattern": "".join(self.pattern),
            "uncacheable": self.uncacheable,
        }


@dataclass
class DecisionGroup:
    """The accumulated error of one deciding branch and its latest decision (followed by the other branch)."""

    accumulated: float = 0.0
    step: int | None = None
    skip: bool = False


@dataclass(frozen=True)
class Admission:
    """Where one admitted call sits."""

    branch: str
    group: str
    decides: bool
    step: int
    local: int
    length: int


class RequestState:
    """Bookkeeping of one request on one handle.

    Args:
        request_id: the request.
        branch_decision: ``"cond"`` or ``"separate"`` (see :class:`~worldfoundry_easycache.options.Options`).
    """

    def __init__(self, request_id: str, branch_decision: str) -> None:
        self.request_id = request_id
        self.branch_decision = branch_decision
        self.begun = False
        self.schedule: RequestSchedule | None = None
        self.tracker: ScheduleTracker | None = None
        self.label: str | None = None
        self.siblings: dict[str, Any] = {}
        self.phase_length: int | None = None
        self.branches: dict[str, BranchRecord] = {}
        self.groups: dict[str, DecisionGroup] = {}
        self.started = False
        self.failure: str | None = None

    # ------------------------------------------------------------------ schedule
    def set_schedule(self, schedule: RequestSchedule, label: str | None, siblings: dict[str, Any]) -> None:
        if self.schedule is not None:
            raise RequestError(f"{PLUGIN_NAME}: request {self.request_id!r} already has a schedule (it is immutable)")
        if self.started:
            raise RequestError(
                f"{PLUGIN_NAME}: request {self.request_id!r}: the schedule must be prepared before the first model call"
            )
        self.schedule = schedule
        self.label = label
        self.siblings = siblings
        if label is not None and any(p.expert == label for p in schedule.phases):
            self.tracker = ScheduleTracker(self.request_id, schedule, expert=label)
            self.phase_length = schedule.phase_of(label).length

    # ------------------------------------------------------------------ admission
    def admit(self, ctx: RequestContext, *, routed: bool) -> Admission:
        """Check one call against the schedule / context and the branch order; return its placement.

        Raises:
            RequestError: missing step information, timestep or expert differing from the schedule, duplicate,
                out-of-order or non-consecutive step, ``uncond`` before ``cond`` under ``branch_decision="cond"``.
        """
        if self.failure is not None:
            raise RequestError(
                f"{PLUGIN_NAME}: request {self.request_id!r} failed earlier ({self.failure}); "
                "end it and start a new one"
            )
        step = ctx.step_index
        if step is None:
            raise RequestError(
                f"{PLUGIN_NAME}: request {self.request_id!r}: the context has no step_index; the runner sets it "
                "(or use request_scope(RequestContext(request_id, branch, step_index, timestep, ...)))"
            )
        if ctx.branch not in (None, *BRANCHES):
            raise RequestError(f"{PLUGIN_NAME}: unknown CFG branch {ctx.branch!r}; expected 'cond', 'uncond' or None")
        branch = ctx.branch or SINGLE_BRANCH
        local, length = self._placement(ctx, step, routed)
        record = self.branches.get(branch)
        last = record.last_local if record is not None else None
        expected = 0 if last is None else last + 1
        if last is not None and local == last:
            raise RequestError(
                f"{PLUGIN_NAME}: request {self.request_id!r}: step {step} branch {branch!r} called twice"
            )
        if last is not None and local < last:
            raise RequestError(
                f"{PLUGIN_NAME}: request {self.request_id!r}: step {step} branch {branch!r} called after a later step "
                "(out of order)"
            )
        if local != expected:
            raise RequestError(
                f"{PLUGIN_NAME}: request {self.request_id!r}: branch {branch!r} expected its phase step {expected}, "
                f"got {local} (global step {step}); steps must be called in order without gaps"
            )
        group, decides = self._group_of(branch)
        if decides:
            leader = self.group(group)
            leader.step = step
            leader.skip = False
        else:
            leader = self.groups.get(group)
            if leader is None or leader.step != step:
                raise RequestError(
                    f"{PLUGIN_NAME}: request {self.request_id!r} step {step}: branch 'uncond' was called before "
                    "'cond'. "
                    "With branch_decision='cond' the runner must call the cond branch first at every step "
                    "(or use branch_decision='separate')"
                )
        if record is None:
            record = self.branches[branch] = BranchRecord(TransformationCache(track_rate=decides))
        record.last_local = local
        self.started = True
        return Admission(branch, group, decides, step, local, length)

    def _placement(self, ctx: RequestContext, step: int, routed: bool) -> tuple[int, int]:
        if self.schedule is not None:
            if self.tracker is None:
                raise RequestError(
                    f"{PLUGIN_NAME}: request {self.request_id!r} step {step}: expert {self.label!r} has no phase in "
                    f"the request schedule (experts: {[p.expert for p in self.schedule.phases]})"
                )
            if ctx.timestep is None:
                raise RequestError(
                    f"{PLUGIN_NAME}: request {self.request_id!r} step {step}: the context has no timestep"
                )
            expert = ctx.expert if ctx.expert is not None and routed else self.label
            first_call = not self.started
            placement = self.tracker.check_call(step, float(ctx.timestep), str(expert), ctx.branch)
            for name, value, expected in (
                ("expert_step_index", ctx.expert_step_index, placement.expert_step_index),
                ("expert_phase_length", ctx.expert_phase_length, placement.expert_phase_length),
                ("num_steps", ctx.num_steps, self.schedule.num_steps),
            ):
                if value is not None and value != expected:
                    raise RequestError(
                        f"{PLUGIN_NAME}: request {self.request_id!r} step {step}: context {name}={value} but the "
                        f"schedule gives {expected}"
                    )
            if first_call:
                self._check_previous_phases(step)
            return placement.expert_step_index, placement.expert_phase_length
        if routed and (ctx.expert_step_index is None or ctx.expert_phase_length is None):
            raise RequestError(
                f"{PLUGIN_NAME}: request {self.request_id!r}: routed experts need a prepared request schedule "
                "(session.prepare_request_schedule) or expert_step_index/expert_phase_length in the context"
            )
        local = ctx.expert_step_index if ctx.expert_step_index is not None else step
        length = ctx.expert_phase_length if ctx.expert_phase_length is not None else ctx.num_steps
        if length is None:
            raise RequestError(
                f"{PLUGIN_NAME}: request {self.request_id!r} step {step}: the context has neither num_steps nor "
                "expert_phase_length, so the final dense steps cannot be placed"
            )
        if self.phase_length is None:
            self.phase_length = int(length)
        elif int(length) != self.phase_length:
            raise RequestError(
                f"{PLUGIN_NAME}: request {self.request_id!r} step {step}: phase length changed from "
                f"{self.phase_length} to {length}"
            )
        if not 0 <= local < self.phase_length:
            raise RequestError(
                f"{PLUGIN_NAME}: request {self.request_id!r}: step {local} outside its phase 0..{self.phase_length - 1}"
            )
        return int(local), self.phase_length

    def _check_previous_phases(self, step: int) -> None:
        schedule = self.schedule
        if schedule is None or self.label is None:
            return
        for phase in schedule.phases:
            if phase.expert == self.label:
                return
            sibling = self.siblings.get(phase.expert)
            if sibling is None or not sibling.phase_finished(self.request_id):
                raise RequestError(
                    f"{PLUGIN_NAME}: request {self.request_id!r}: expert {self.label!r} called at step {step} before "
                    f"expert {phase.expert!r} finished its phase "
                    f"(steps {phase.start}..{phase.start + phase.length - 1})"
                )

    def _group_of(self, branch: str) -> tuple[str, bool]:
        if self.branch_decision == "separate" or branch == SINGLE_BRANCH:
            return branch, True
        return "cond", branch == "cond"

    def group(self, name: str) -> DecisionGroup:
        group = self.groups.get(name)
        if group is None:
            group = self.groups[name] = DecisionGroup()
        return group

    # ------------------------------------------------------------------ completion
    def phase_finished(self) -> bool:
        """Every branch that ran reached the end of this expert's phase (and the schedule's phase is covered)."""
        if self.phase_length is None or not self.branches:
            return False
        return all(r.last_local == self.phase_length - 1 for r in self.branches.values())

    def completeness_problems(self) -> list[str]:
        problems: list[str] = []
        if self.tracker is not None:
            try:
                self.tracker.finish()
            except RequestError as exc:
                problems.append(str(exc))
        if self.phase_length is not None:
            for name, record in self.branches.items():
                done = -1 if record.last_local is None else record.last_local
                if done != self.phase_length - 1:
                    problems.append(
                        f"branch {name!r} stopped at phase step {done} of {self.phase_length} (phase left incomplete)"
                    )
        return problems

    # ------------------------------------------------------------------ release and receipt
    def tensors(self) -> list[torch.Tensor]:
        return [t for record in self.branches.values() for t in record.tensors()]

    def release(self) -> None:
        for record in self.branches.values():
            record.release()
        self.siblings = {}

    def summary(self, outcome: str, problems: list[str]) -> dict[str, Any]:
        phase: dict[str, Any] | None = None
        if self.schedule is not None and self.tracker is not None and self.label is not None:
            p = self.schedule.phase_of(self.label)
            phase = {"expert": p.expert, "start": p.start, "length": p.length}
        elif self.phase_length is not None:
            phase = {"expert": self.label, "start": None, "length": self.phase_length}
        return {
            "outcome": outcome,
            "expert": self.label,
            "phase": phase,
            "branch_decision": self.branch_decision,
            "branches": {name: record.to_json() for name, record in sorted(self.branches.items())},
            "problems": [p[:300] for p in problems[:8]],
            "failure": self.failure,
        }
