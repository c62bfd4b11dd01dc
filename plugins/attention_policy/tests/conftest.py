"""Tiny Wan models (T2V, I2V), provider and acceleration registries, and an op recorder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
from worldfoundry_attention_policy.options import Options
from worldfoundry_attention_policy.plugin import make_prepare

from worldfoundry import testing
from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV, AccelerationRegistry
from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry

torch.set_num_threads(1)

#: the op PyTorch's default SDPA runs on CPU for float32 (the dense path of every call)
FLASH_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"
TEST_PROVIDER = "chunked_softmax"
TEXT_TOKENS = 512  # Wan's processor splits image tokens off the front of a 512-token text context


@dataclass
class WanCase:
    model: nn.Module
    image: bool

    def inputs(self, seed: int = 0) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        kwargs: dict[str, Any] = {"hidden_states": torch.randn(1, 16, 2, 8, 8, generator=g),
                                  "timestep": torch.tensor([500]),
                                  "encoder_hidden_states": torch.randn(1, TEXT_TOKENS if self.image else 24, 32,
                                                                       generator=g)}
        if self.image:
            kwargs["encoder_hidden_states_image"] = torch.randn(1, 4, 32, generator=g)
        return kwargs

    def run(self, seed: int = 0) -> torch.Tensor:
        with torch.no_grad():
            return self.model(**self.inputs(seed), return_dict=False)[0]


def build_wan(image: bool = False) -> WanCase:
    extra = {"image_dim": 32, "added_kv_proj_dim": 64} if image else {}
    return WanCase(testing.tiny_wan(0, weight_scale=None, **extra), image)


OpRecorder = testing.OpRecorder


@pytest.fixture(autouse=True)
def _all_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)


@pytest.fixture
def op_recorder() -> type[OpRecorder]:
    return OpRecorder


@pytest.fixture
def wan_case() -> WanCase:
    return build_wan()


@pytest.fixture
def wan_i2v() -> WanCase:
    return build_wan(image=True)


@pytest.fixture
def providers() -> AttentionProviderRegistry:
    """The built-in providers and the test distribution's ``chunked_softmax`` (found through its entry point)."""
    import importlib.metadata

    try:
        importlib.metadata.version("worldfoundry-test-attention-provider")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the test provider distribution is not installed: pip install -e tests/fixtures/attention_provider_dist")
    registry = AttentionProviderRegistry(allowlist=[TEST_PROVIDER])
    assert TEST_PROVIDER in registry.names()
    return registry


@pytest.fixture
def registry(providers: AttentionProviderRegistry) -> AccelerationRegistry:
    registry = AccelerationRegistry(discover=False)
    registry.register("attention_policy", make_prepare(providers), options=Options)
    return registry


@pytest.fixture
def make_registry() -> Callable[[AttentionProviderRegistry], AccelerationRegistry]:
    def make(providers: AttentionProviderRegistry) -> AccelerationRegistry:
        registry = AccelerationRegistry(discover=False)
        registry.register("attention_policy", make_prepare(providers), options=Options)
        return registry

    return make
