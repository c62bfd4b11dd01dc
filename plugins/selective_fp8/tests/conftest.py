"""Tiny seeded diffusers models of the three families, fixed Wan inputs and an independent model fingerprint."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn as nn

from worldfoundry import testing

WAN_CONFIG: dict[str, Any] = dict(testing.WAN_TINY)
WAN_FFN_PATHS = ["blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2"]


def build_wan(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    return testing.tiny_wan(seed, weight_scale=0.05, dtype=dtype, **WAN_CONFIG)


def build_sana_video() -> nn.Module:
    return testing.tiny_sana_video(0)


def build_minimax_h3() -> nn.Module:
    return testing.tiny_minimax_h3(0, hidden_size=64, ffn_dim=128, in_channels=8, time_embed_hidden_dim=64,
                                   time_embed_dim=32, rope_freq_dim=8, patch_size=(1, 2, 2))


def wan_inputs(dtype: torch.dtype = torch.float32, frames: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 16, frames, 8, 8, generator=g).to(dtype),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g).to(dtype),
    }


def run_wan(model: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return testing.run_model(model, wan_inputs(dtype))


def fingerprint(model: nn.Module) -> testing.ModelFingerprint:
    """:func:`worldfoundry.testing.fingerprint` of the guarded model (the request guard stays by design)."""
    dtype = next(model.parameters()).dtype
    return testing.fingerprint(testing.guarded(model), forward=lambda m: run_wan(m, dtype))


def allow_cpu_fp8(session: Any, handle: Any) -> None:
    """Let the installed plugin run FP8 on the CPU where this torch build can; skip the calling test elsewhere.

    Whether ``torch._scaled_mm`` has a rowwise CPU kernel depends on the build (CPU builds of torch 2.13 do; the
    CUDA build of torch 2.11 does not). The runtime asks its capability probe; when the probe says no, every
    call on the CPU must fall back visibly with the probe's reason and run the dense Linear bitwise, which is
    checked here before the test is skipped.
    """
    from worldfoundry.core.acceleration.context import RequestContext, request_scope

    cpu = torch.device("cpu")
    verdict = handle.runtime.allow_device(cpu)
    if verdict is None:
        return
    assert verdict.startswith("rowwise torch._scaled_mm"), verdict
    path, target = next(iter(handle.runtime.targets.items()))
    linear = target.linear
    x = torch.randn(4, linear.in_features, dtype=linear.weight.dtype)
    with torch.no_grad(), request_scope(RequestContext("probe-fallback")):
        out = linear(x)
        dense = nn.functional.linear(x, linear.weight, linear.bias)
    record = session.execution_report()["plugins"]["selective_fp8"]["model"]["requests"]["probe-fallback"]
    assert record["module_fallbacks"] == {path: {verdict: 1}}
    assert torch.equal(out, dense)
    session.uninstall()
    pytest.skip(f"no FP8 path on this CPU build (visible fallback checked): {verdict}")


assert_same = testing.assert_same_model


@pytest.fixture
def kit() -> ModuleType:
    """This module's helpers (conftest modules are not importable under importlib mode)."""
    return sys.modules[__name__]


@pytest.fixture
def wan() -> nn.Module:
    return build_wan()
