"""Block fusion stacked on other plugins: every stack is bitwise the same stack without block fusion (CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations

pytestmark = pytest.mark.usefixtures("kernels")
STEPS = 3


def _adapter(model: torch.nn.Module, path: str, rank: int = 2) -> str:
    g = torch.Generator().manual_seed(5)
    state = {}
    for i in range(len(model.blocks)):
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                m = model.get_submodule(f"blocks.{i}.{attn}.{proj}")
                state[f"blocks.{i}.{attn}.{proj}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.2
                state[f"blocks.{i}.{attn}.{proj}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.2
    save_file(state, path)
    return path


def _drive(model: torch.nn.Module, kit: Any, request_id: str) -> list[torch.Tensor]:
    """One request of STEPS steps x two CFG branches, as the runner drives it."""
    guard = attach_request_guard(model)
    prompts = {"cond": kit.wan_inputs(seed=1), "uncond": kit.wan_inputs(seed=2)}
    outs = []
    guard.begin_request(request_id)
    try:
        for step in range(STEPS):
            for branch, inputs in prompts.items():
                t = 900 - 300 * step
                ctx = RequestContext(request_id, branch, step, float(t), None, STEPS)
                with request_scope(ctx), torch.no_grad():
                    timestep = torch.tensor([t], device=inputs["hidden_states"].device)
                    outs.append(model(**{**inputs, "timestep": timestep})[0])
    finally:
        guard.end_request(request_id)
    return outs


def _fp8_unavailable(device: torch.device) -> str | None:
    """Why the FP8 path cannot run on ``device`` in this torch build (the CPU path is probed, not assumed)."""
    from worldfoundry.core.acceleration.quantization.fp8_linear import (
        fp8_linear_fallback_reason,
        rowwise_scaled_mm_unavailable_reason,
    )

    if device.type == "cpu":
        return rowwise_scaled_mm_unavailable_reason(device)
    return fp8_linear_fallback_reason(device)


def _force_fp8_on_cpu(session: Any, device: torch.device) -> None:
    if device.type != "cpu":
        return
    handle = session.handles("selective_fp8")["model"]
    handle.runtime.device_reasons[device] = None  # the probe passed: run the FP8 path although the policy is GPU-only


STACKS = {
    "wan_cross_kv_fusion": {"wan_cross_kv_fusion": {"min_tokens": 1}},
    "optimized_mha": {"optimized_mha": {"self": {"fusion": "qkv"}, "cross": {"fusion": "kv"}}},
    "selective_fp8": {"selective_fp8": {"min_tokens": 1}},
    "easycache": {"easycache": {"threshold": 1e30, "warmup_steps": 1, "final_dense_steps": 0}},
    "attention_lora": {"attention_lora": {"rank": 2, "scale": 0.5}},
    "mha_self+static_kv": {"optimized_mha": {"self": {"fusion": "qkv"}}, "wan_cross_kv_fusion": {"min_tokens": 1}},
}


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_stack_with_block_fusion_is_bitwise_the_stack_without(stack: str, kit: Any, tmp_path: Any,
                                                              kernels: torch.device) -> None:
    if "selective_fp8" in STACKS[stack]:
        reason = _fp8_unavailable(kernels)
        if reason is not None:
            pytest.skip(f"selective_fp8 cannot run its FP8 path here: {reason}")
    model = kit.build_wan()
    spec = {k: dict(v) for k, v in STACKS[stack].items()}
    if "attention_lora" in spec:
        spec["attention_lora"]["path"] = _adapter(model, str(tmp_path / "lora.safetensors"))
    reg = kit.full_registry()
    results = {}
    for fused in (False, True):
        full = {**spec, "wan_block_fusion": {}} if fused else spec
        session = install_diffusion_accelerations(model, full, registry=reg)
        if "selective_fp8" in spec:
            _force_fp8_on_cpu(session, kernels)
        results[fused] = _drive(model, kit, f"r-{fused}")
        report = session.execution_report()
        session.uninstall()
        for name in spec:
            assert report["plugins"][name]["model"]["requests"][f"r-{fused}"]["modules"], name
        if fused:
            record = report["plugins"]["wan_block_fusion"]["model"]["requests"]["r-True"]
            assert record["fallbacks"] == {}, record["fallbacks"]
            assert record["counters"]["gated_residual"] > 0
    assert len(results[True]) == len(results[False]) == 2 * STEPS
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)
