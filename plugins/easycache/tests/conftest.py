"""Fixtures for the EasyCache tests: tiny Wan transformers and a flow-matching Euler loop with CFG.

The loop drives the model the way the native runner does: ``begin_request``, an optional request schedule,
then per step one call per CFG branch (``cond`` first) inside a ``RequestContext``, and ``end_request`` in
``finally``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn
from diffusers import WanTransformer3DModel

from worldfoundry import testing
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import (
    RequestGuard,
    attach_request_guard,
    get_request_guard,
)
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.acceleration.schedule import RequestSchedule
from worldfoundry.core.acceleration.session import get_session
from worldfoundry_easycache.plugin import prepare

TINY_WAN = dict(
    num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
    ffn_dim=32, num_layers=2, rope_max_seq_len=32,
)
LATENT_SHAPE = (1, 4, 2, 4, 4)
TEXT_SHAPE = (1, 6, 16)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest (and steadiest on a loaded machine) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_tiny_wan(seed: int = 0, **overrides: Any) -> WanTransformer3DModel:
    return testing.tiny_wan(seed, weight_scale=None, **{**TINY_WAN, **overrides})


@pytest.fixture
def registry() -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("easycache", prepare)
    return reg


@dataclass
class Inputs:
    latents: torch.Tensor
    cond: torch.Tensor
    uncond: torch.Tensor


def make_inputs(seed: int = 1) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    return Inputs(torch.randn(*LATENT_SHAPE, generator=gen), torch.randn(*TEXT_SHAPE, generator=gen),
                  torch.randn(*TEXT_SHAPE, generator=gen))


def timesteps_for(steps: int) -> list[float]:
    sigmas = torch.linspace(1.0, 0.0, steps + 1)[:-1]
    return [float(s * 1000) for s in sigmas]


def split_schedule(steps: int, high_steps: int) -> RequestSchedule:
    """A Wan2.2-style schedule: the first ``high_steps`` steps on ``high``, the rest on ``low``."""
    ts = timesteps_for(steps)
    return RequestSchedule.from_steps(ts, ["high"] * high_steps + ["low"] * (steps - high_steps))


@dataclass
class LoopResult:
    latents: torch.Tensor
    outputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)


class EulerLoop:
    """Flow-matching Euler loop with optional CFG over one model or routed experts.

    Args:
        experts: ``{"model": m}`` or ``{"high": m1, "low": m2}`` (routed by ``schedule``).
    """

    def __init__(self, experts: Mapping[str, nn.Module]) -> None:
        self.experts = dict(experts)
        guards = {id(g): g for g in (get_request_guard(m) for m in self.experts.values()) if g is not None}
        guard = next(iter(guards.values()), None) or RequestGuard("test")
        for m in self.experts.values():
            attach_request_guard(m, guard)
        self.guard = guard

    def run(self, request_id: str, inputs: Inputs, steps: int, **kwargs: Any) -> LoopResult:
        """Run a whole request; see :meth:`iterate` for the arguments."""
        *_, last = self.iterate(request_id, inputs, steps, **kwargs)
        return last

    def iterate(self, request_id: str, inputs: Inputs, steps: int, *, cfg: bool = True, guidance: float = 5.0,
                schedule: RequestSchedule | None = None, before_step: Callable[[int], None] | None = None,
                context: Callable[[RequestContext], RequestContext] | None = None,
                branches: tuple[str, ...] | None = None) -> Iterator[LoopResult]:
        """Yield the partial result after every step (so two requests can be interleaved step by step)."""
        x = inputs.latents.clone()
        ts = list(schedule.timesteps) if schedule is not None else timesteps_for(steps)
        sigmas = [t / 1000 for t in ts] + [0.0]
        order = branches or (("cond", "uncond") if cfg else ("cond",))
        result = LoopResult(x)
        self.guard.begin_request(request_id)
        try:
            session = get_session(next(iter(self.experts.values())))
            if schedule is not None and session is not None:
                session.prepare_request_schedule(request_id, schedule)
            for i, t in enumerate(ts):
                if before_step is not None:
                    before_step(i)
                if schedule is not None:
                    place = schedule.locate(i)
                    expert, local, length = place.expert, place.expert_step_index, place.expert_phase_length
                else:
                    expert, local, length = next(iter(self.experts)), None, None
                outs: dict[str, torch.Tensor] = {}
                result.inputs.append(x)
                for branch in order:
                    ctx = RequestContext(request_id, branch, i, t, expert, len(ts), local, length)
                    if context is not None:
                        ctx = context(ctx)
                    emb = inputs.cond if branch == "cond" else inputs.uncond
                    with request_scope(ctx), torch.no_grad():
                        out = self.experts[expert](hidden_states=x, timestep=torch.tensor([t]),
                                                   encoder_hidden_states=emb, return_dict=False)
                    outs[branch] = out[0]
                result.outputs.append(outs)
                if "uncond" in outs and "cond" in outs:
                    v = outs["uncond"] + guidance * (outs["cond"] - outs["uncond"])
                else:
                    v = outs[order[0]]
                x = x + (sigmas[i + 1] - sigmas[i]) * v
                result.latents = x
                if i < len(ts) - 1:
                    yield result
        finally:
            self.guard.end_request(request_id)
        yield result


@pytest.fixture
def helpers() -> SimpleNamespace:
    """Model, input, schedule and loop builders for the tests."""
    return SimpleNamespace(tiny_wan=make_tiny_wan, inputs=make_inputs, timesteps=timesteps_for,
                           split_schedule=split_schedule, loop=EulerLoop)
