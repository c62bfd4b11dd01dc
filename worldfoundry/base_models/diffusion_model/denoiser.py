"""``Denoiser``: the adapter around one diffusers DiT (or two routed experts) that plugins rely on.

It attaches one request guard to every expert (one guard group), installs/uninstalls accelerations as one
session over all experts, routes steps to experts by the boundary, checks routed calls against the
request schedule and exposes the runtime report.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from worldfoundry.base_models.diffusion_model.optimizations.families import ModelFamily, family_of
from worldfoundry.core.acceleration.context import current_request
from worldfoundry.core.acceleration.guard import RequestGuard, attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.acceleration.schedule import RequestSchedule, ScheduleTracker
from worldfoundry.core.acceleration.session import (
    AccelerationSession,
    get_session,
    runtime_optimization_report,
)
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import RequestError

logger = logging.getLogger(__name__)


class Denoiser:
    """One DiT or a routed pair of experts (``{"high": ..., "low": ...}``).

    Attributes:
        supports_acceleration_plugins: always ``True``: the loader installs accelerations on it.
        experts: label -> diffusers module, in routing order (high noise first).
        boundary_ratio: Wan2.2 switch point as a fraction of the scheduler's training timesteps.
    """

    supports_acceleration_plugins = True

    def __init__(self, experts: Mapping[str, nn.Module], *, boundary_ratio: float | None = None,
                 name: str = "denoiser") -> None:
        if not experts:
            raise ValueError("a denoiser needs at least one expert")
        if len(experts) > 1 and boundary_ratio is None:
            raise ValueError("routed experts need a boundary_ratio")
        self.experts: dict[str, nn.Module] = dict(experts)
        self.boundary_ratio = boundary_ratio
        self.family: ModelFamily = family_of(next(iter(self.experts.values())))
        self.guard = RequestGuard(name)
        for module in self.experts.values():
            attach_request_guard(module, self.guard)
        self._trackers: dict[str, ScheduleTracker] = {}

    # ------------------------------------------------------------------ modules
    @property
    def model(self) -> nn.Module:
        """The first (or only) diffusers module."""
        return next(iter(self.experts.values()))

    @property
    def routed(self) -> bool:
        return len(self.experts) > 1

    def install_target(self) -> nn.Module | dict[str, nn.Module]:
        return dict(self.experts) if self.routed else self.model

    @property
    def session(self) -> AccelerationSession | None:
        return get_session(self.model)

    # ------------------------------------------------------------------ accelerations
    def install(self, spec: Mapping[str, Any], policy: RuntimePolicy | None = None, *,
                registry: AccelerationRegistry | None = None) -> AccelerationSession:
        """Install accelerations on every expert as one session (see ``install_diffusion_accelerations``)."""
        return install_diffusion_accelerations(self.install_target(), spec, policy, registry=registry)

    def uninstall(self) -> None:
        session = self.session
        if session is not None:
            session.uninstall()

    def runtime_optimization_report(self) -> dict[str, Any]:
        """Install receipt, per-plugin execution reports (per request, bounded) and guard state."""
        report = runtime_optimization_report(self.model)
        report["experts"] = list(self.experts)
        return report

    # ------------------------------------------------------------------ routing
    def expert_for(self, timestep: float, num_train_timesteps: int) -> str:
        labels = list(self.experts)
        if not self.routed:
            return labels[0]
        boundary = self.boundary_ratio * num_train_timesteps  # type: ignore[operator]
        return labels[0] if float(timestep) >= boundary else labels[1]

    def build_schedule(self, timesteps: Sequence[Any], num_train_timesteps: int) -> RequestSchedule:
        ts = [float(t) for t in timesteps]
        return RequestSchedule.from_steps(ts, [self.expert_for(t, num_train_timesteps) for t in ts])

    # ------------------------------------------------------------------ requests
    def begin_request(self, request_id: str) -> None:
        self.guard.begin_request(request_id)

    def prepare_request_schedule(self, request_id: str, schedule: RequestSchedule) -> None:
        """Register the immutable schedule of a request before its first model call (routed denoisers)."""
        if request_id not in self.guard.active_request_ids():
            raise RequestError(f"prepare_request_schedule: request {request_id!r} is not active; begin it first")
        if request_id in self._trackers:
            raise RequestError(f"request {request_id!r} already has a schedule")
        unknown = sorted(set(schedule.experts) - set(self.experts))
        if unknown:
            raise RequestError(f"schedule names unknown expert(s) {unknown}; experts: {list(self.experts)}")
        self._trackers[request_id] = ScheduleTracker(request_id, schedule)
        session = self.session
        if session is not None:
            session.prepare_request_schedule(request_id, schedule)

    def end_request(self, request_id: str) -> None:
        """End a request: check its schedule was completed, then release it (always, also on error)."""
        tracker = self._trackers.pop(request_id, None)
        try:
            if tracker is not None:
                tracker.finish()
        finally:
            self.guard.end_request(request_id)

    def abort_request(self, request_id: str) -> None:
        """End a request after a failure: no completeness check, ownership always released."""
        self._trackers.pop(request_id, None)
        self.guard.release_thread_forwards()
        if request_id in self.guard.active_request_ids():
            try:
                self.guard.end_request(request_id)
            except Exception as exc:  # the original failure matters more; the request is released anyway
                logger.error("ending request %r after a failure also failed: %s", request_id, exc)

    def __call__(self, expert: str, **model_kwargs: Any) -> Any:
        """Call one expert with the current request context checked against its schedule."""
        ctx = current_request()
        if ctx is not None and ctx.request_id in self._trackers:
            self._trackers[ctx.request_id].check_call(
                ctx.step_index if ctx.step_index is not None else -1, ctx.timestep or 0.0, expert, ctx.branch
            )
        module = self.experts.get(expert)
        if module is None:
            raise RequestError(f"unknown expert {expert!r}; experts: {list(self.experts)}")
        with torch.no_grad():
            return module(**model_kwargs)

    def release(self) -> None:
        """Drop the modules (after uninstall); the denoiser is unusable afterwards."""
        self._trackers.clear()
        self.experts.clear()
