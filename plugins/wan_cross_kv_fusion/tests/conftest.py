"""Tiny Wan models (T2V, I2V), a fresh registry and a helper that drives a request step by step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn as nn
from worldfoundry_wan_cross_kv_fusion.plugin import prepare

from worldfoundry import testing
from worldfoundry.core.acceleration.registry import AccelerationRegistry

TEXT_TOKENS = 512  # Wan's processor splits image tokens off the front of a 512-token text context


@dataclass
class WanCase:
    model: nn.Module
    image: bool
    prompts: dict[str, torch.Tensor] = field(default_factory=dict)
    image_embeds: torch.Tensor | None = None

    def latents(self, step: int) -> torch.Tensor:
        return torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(100 + step))

    def call(self, step: int, branch: str, prompt: torch.Tensor | None = None) -> torch.Tensor:
        kwargs: dict[str, Any] = {"encoder_hidden_states": self.prompts[branch] if prompt is None else prompt}
        if self.image_embeds is not None:
            kwargs["encoder_hidden_states_image"] = self.image_embeds
        with torch.no_grad():
            return self.model(self.latents(step), torch.tensor([900 - 100 * step]), **kwargs, return_dict=False)[0]

    def run_request(self, request_id: str, steps: int, branches: tuple[str, ...] = ("cond", "uncond"),
                    before_step: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """Begin a request on the model's guard, run steps x branches inside request scopes, end it."""
        return testing.run_request(self.model, request_id, self.call, steps=steps, branches=branches,
                                   timestep=lambda step: 900 - 100 * step, before_step=before_step)

    def dense_outputs(self, steps: int, branches: tuple[str, ...] = ("cond", "uncond")) -> list[torch.Tensor]:
        return [self.call(step, branch) for step in range(steps) for branch in branches]


def build_wan(image: bool = False, seed: int = 0) -> WanCase:
    extra = {"image_dim": 32, "added_kv_proj_dim": 64} if image else {}
    model = testing.tiny_wan(seed, weight_scale=None, **extra)
    g = torch.Generator().manual_seed(7)
    tokens = TEXT_TOKENS if image else 24
    case = WanCase(model, image, {"cond": torch.randn(1, tokens, 32, generator=g),
                                  "uncond": torch.randn(1, tokens, 32, generator=g)})
    if image:
        case.image_embeds = torch.randn(1, 4, 32, generator=g)
    return case


@pytest.fixture
def wan() -> WanCase:
    return build_wan()


@pytest.fixture
def wan_i2v() -> WanCase:
    return build_wan(image=True)


@pytest.fixture
def builders() -> Callable[..., WanCase]:
    return build_wan


@pytest.fixture
def registry() -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("wan_cross_kv_fusion", prepare)
    return reg


def record_of(session: Any, request_id: str, expert: str = "model") -> dict[str, Any]:
    return session.execution_report()["plugins"]["wan_cross_kv_fusion"][expert]["requests"][request_id]


@pytest.fixture
def record() -> Callable[..., dict[str, Any]]:
    """``record(session, request_id)``: the plugin's execution record of one request."""
    return record_of
