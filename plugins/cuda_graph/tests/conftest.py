"""Tiny Wan models, registries with the graph plugin on a chosen backend, and a request driver."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn as nn
from worldfoundry_cuda_graph.plugin import make_prepare

from worldfoundry import testing
from worldfoundry.core.acceleration.cuda_graph import EagerReplayBackend
from worldfoundry.core.acceleration.registry import AccelerationRegistry


@dataclass
class WanCase:
    """A tiny Wan transformer, its CFG prompts and fixed per-step latents."""

    model: nn.Module
    prompts: dict[str, torch.Tensor] = field(default_factory=dict)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    def latents(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 + step)
        return torch.randn(1, 16, 2, 8, 8, generator=g).to(self.device, self.dtype)

    def inputs(self, step: int, branch: str) -> dict[str, Any]:
        return {"hidden_states": self.latents(step),
                "timestep": torch.tensor([900 - 100 * step], device=self.device),
                "encoder_hidden_states": self.prompts[branch], "return_dict": False}

    def call(self, step: int, branch: str) -> torch.Tensor:
        with torch.no_grad():
            return self.model(**self.inputs(step, branch))[0]

    def run_request(self, request_id: str, steps: int, branches: tuple[str, ...] = ("cond", "uncond"),
                    before_step: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """Begin a request on the model's guard, run steps x branches inside request scopes, end it."""
        return testing.run_request(self.model, request_id, self.call, steps=steps, branches=branches,
                                   timestep=lambda step: 900 - 100 * step, before_step=before_step)


def build_wan(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32, layers: int = 2,
              tokens: int = 24) -> WanCase:
    model = testing.tiny_wan(seed, weight_scale=None, num_layers=layers).to(device, dtype)
    g = torch.Generator().manual_seed(7)
    return WanCase(model, {"cond": torch.randn(1, tokens, 32, generator=g).to(device, dtype),
                           "uncond": torch.randn(1, tokens, 32, generator=g).to(device, dtype)}, device, dtype)


def make_registry(backend: Any = EagerReplayBackend) -> AccelerationRegistry:
    """A fresh registry: ``cuda_graph`` on ``backend`` plus the built-in plugins it is tested beside."""
    from worldfoundry_easycache.plugin import prepare as easycache
    from worldfoundry_optimized_mha.plugin import prepare as optimized_mha
    from worldfoundry_resident_blocks.plugin import prepare as resident_blocks
    from worldfoundry_selective_fp8.plugin import prepare as selective_fp8
    from worldfoundry_wan_cross_kv_fusion.plugin import prepare as wan_cross_kv_fusion

    reg = AccelerationRegistry(discover=False)
    reg.register("cuda_graph", make_prepare(backend))
    reg.register("wan_cross_kv_fusion", wan_cross_kv_fusion)
    reg.register("optimized_mha", optimized_mha)
    reg.register("easycache", easycache)
    reg.register("resident_blocks", resident_blocks)
    reg.register("selective_fp8", selective_fp8)
    return reg


@pytest.fixture
def wan() -> WanCase:
    return build_wan()


@pytest.fixture
def registry() -> AccelerationRegistry:
    return make_registry()


def graph_record(session: Any, request_id: str) -> dict[str, Any]:
    return session.execution_report()["plugins"]["cuda_graph"]["model"]["requests"][request_id]


def graphs(session: Any) -> dict[str, Any]:
    return session.execution_report()["plugins"]["cuda_graph"]["model"]["graphs"]


@pytest.fixture
def tools() -> Any:
    """``tools.build_wan``, ``tools.make_registry``, ``tools.graph_record``, ``tools.graphs``."""
    import types

    return types.SimpleNamespace(build_wan=build_wan, make_registry=make_registry, graph_record=graph_record,
                                 graphs=graphs)
