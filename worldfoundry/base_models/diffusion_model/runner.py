"""The native runner: one denoise loop for every model family.

Per request: encode the conditioning once, draw seeded noise, set the scheduler (with the request's shift),
prepare the routed schedule, then per step pick the expert by the boundary and call the denoiser once per
CFG branch (``"cond"`` first, then ``"uncond"``) inside a :class:`RequestContext` carrying the request id,
branch, step, timestep and expert; combine CFG in float32; step the scheduler. The request is always ended
and ownership released in ``finally`` (also on exceptions and ``KeyboardInterrupt``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from worldfoundry.base_models.diffusion_model.denoiser import Denoiser
from worldfoundry.base_models.diffusion_model.drivers import PreparedInputs, guidance_for
from worldfoundry.base_models.diffusion_model.request import DiffusionRequest
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.errors import InvalidRequestError

logger = logging.getLogger(__name__)

SHIFT_KEYS = ("shift", "flow_shift")


@dataclass
class RunOutput:
    latents: torch.Tensor
    prepared: PreparedInputs
    schedule: dict[str, Any]
    timings: dict[str, Any] = field(default_factory=dict)


#: A callable the loop runs before every step, outside the step's time and outside ``denoise_s`` (the bench's host
#: gate: :mod:`worldfoundry.bench.host_gate`); its total time is recorded as ``timings["between_steps_s"]``.
BETWEEN_STEPS: ContextVar[Callable[[], Any] | None] = ContextVar("worldfoundry_between_steps", default=None)


class _Between:
    """Runs :data:`BETWEEN_STEPS`'s callable (if any) and adds up the seconds it took."""

    def __init__(self) -> None:
        self.hook = BETWEEN_STEPS.get()
        self.seconds = 0.0

    def __call__(self) -> None:
        if self.hook is not None:
            start = time.perf_counter()
            self.hook()
            self.seconds += time.perf_counter() - start

    def record(self, timings: dict[str, Any]) -> None:
        if self.hook is not None:
            timings["between_steps_s"] = self.seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _close_step(timings: dict[str, Any], t_step: float, issued: float, device: torch.device) -> None:
    """Record a step's time (synchronized) and the host's part of it: until the model's work of the step was issued
    (``issued``), before the scheduler's step -- close to the step's time when the host is the bottleneck, far below
    it when the device is. The scheduler is left out because it may wait for the device itself (diffusers' UniPC
    solves a small linear system on the device every step), which would make every step look host-bound."""
    _sync(device)
    timings["steps_s"].append(time.perf_counter() - t_step)
    timings["host_steps_s"].append(issued - t_step)


def fresh_scheduler(base: Any, flow_shift: float | None) -> Any:
    """A new scheduler per request (schedulers keep history); the request's shift overrides the recipe's."""
    config = dict(base.config)
    if flow_shift is not None:
        keys = [k for k in SHIFT_KEYS if k in config]
        if not keys:
            raise InvalidRequestError(f"flow_shift: scheduler {type(base).__name__} has no shift setting")
        for key in keys:
            config[key] = float(flow_shift)
    return type(base).from_config(config)


class NativeRunner:
    """Runs :class:`DiffusionRequest` s through a :class:`Denoiser` with a family driver."""

    def __init__(self, denoiser: Denoiser, driver: Any, scheduler: Any, *, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.denoiser = denoiser
        self.driver = driver
        self.scheduler = scheduler
        self.device = device
        self.dtype = dtype

    def run(self, request: DiffusionRequest, *, progress: bool = False) -> RunOutput:
        """Denoise one request (which must already carry its defaults and an id)."""
        if request.num_inference_steps is None or request.request_id is None:
            raise InvalidRequestError("run() needs a request with defaults applied (num_inference_steps, request_id)")
        self.driver.validate(request)
        rid, steps = request.request_id, request.num_inference_steps
        cfg = request.guidance_scale is not None and request.guidance_scale > 1.0
        t_start = time.perf_counter()
        scheduler = fresh_scheduler(self.scheduler, request.flow_shift)
        scheduler.set_timesteps(steps, device=self.device)
        timesteps = scheduler.timesteps
        if len(timesteps) != steps:
            raise InvalidRequestError(f"scheduler produced {len(timesteps)} timesteps for {steps} steps")
        num_train = int(scheduler.config.num_train_timesteps)
        timestep_values = timesteps.tolist()  # host copies: reading a device timestep per step would synchronise
        schedule = self.denoiser.build_schedule(timestep_values, num_train)
        expert_order = list(self.denoiser.experts)
        timings: dict[str, Any] = {"steps_s": [], "host_steps_s": []}  # host_steps_s: until the model's work is issued

        self.denoiser.begin_request(rid)
        completed = False
        try:
            with torch.no_grad():
                prepared = self.driver.prepare(request, self.device, self.dtype, cfg)
            _sync(self.device)
            timings["encode_s"] = time.perf_counter() - t_start
            self.denoiser.prepare_request_schedule(rid, schedule)
            latents = prepared.latents
            branches = ["cond", "uncond"] if cfg else ["cond"]
            t_loop, between = time.perf_counter(), _Between()
            for i, t in enumerate(tqdm(timesteps, total=steps, disable=not progress, desc=rid, leave=False)):
                between()
                t_step = time.perf_counter()
                placement = schedule.locate(i)
                scale = guidance_for(request, expert_order.index(placement.expert))
                outputs = {}
                for branch in branches:
                    ctx = RequestContext(rid, branch, i, float(timestep_values[i]), placement.expert, steps,
                                         placement.expert_step_index, placement.expert_phase_length)
                    kwargs = self.driver.model_kwargs(prepared, latents, t, branch, self.dtype)
                    with request_scope(ctx):
                        out = self.denoiser(placement.expert, **kwargs)
                    outputs[branch] = self.driver.velocity_for(prepared, out)
                issued = time.perf_counter()
                if cfg:
                    velocity = outputs["uncond"] + scale * (outputs["cond"] - outputs["uncond"])
                else:
                    velocity = outputs["cond"]
                latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
                _close_step(timings, t_step, issued, self.device)
            timings["denoise_s"] = time.perf_counter() - t_loop - between.seconds
            between.record(timings)
            completed = True
        finally:
            if completed:
                self.denoiser.end_request(rid)
            else:
                self.denoiser.abort_request(rid)
        timings["run_s"] = time.perf_counter() - t_start
        return RunOutput(latents, prepared, schedule.to_json(), timings)
