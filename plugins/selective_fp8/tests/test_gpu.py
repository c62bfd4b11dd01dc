"""``selective_fp8`` on an FP8-capable CUDA device (sm_89+): ``torch._scaled_mm`` runs once per selected module
per forward, the Triton quantizer is used, each FP8 Linear stays close to bf16, and uninstall is exact.

Skipped without such a device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from worldfoundry_selective_fp8.plugin import prepare
from worldfoundry_selective_fp8.ffn_fusion import FUSED_KIND, GELU_REFERENCE_COUNTER
from worldfoundry_selective_fp8.runtime import QUANT_REFERENCE_COUNTER

from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import TRITON_AVAILABLE
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and TRITON_AVAILABLE


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _fp8_gpu(), reason="needs CUDA sm_89+ and triton")]


class CountScaledMM(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def registry() -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("selective_fp8", prepare)
    return reg


def build(kit) -> nn.Module:
    return kit.build_wan(dtype=torch.bfloat16).cuda()


def run(model: nn.Module, request_id: str | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 16, 4, 16, 16, generator=g).to("cuda", torch.bfloat16),  # 256 tokens
        "timestep": torch.tensor([500], device="cuda"),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g).to("cuda", torch.bfloat16),
    }
    with torch.inference_mode():
        if request_id is None:
            return model(**inputs, return_dict=False)[0]
        with request_scope(RequestContext(request_id)):
            return model(**inputs, return_dict=False)[0]


def test_scaled_mm_once_per_selected_module_and_receipts(kit):
    model = build(kit)
    dense = run(model).float()
    session = install_diffusion_accelerations(model, {"selective_fp8": {"min_tokens": 128}},
                                              RuntimePolicy(device="cuda", dtype="bf16"), registry=registry())
    with CountScaledMM() as counter:
        out = run(model, "r1").float()
    assert counter.calls == len(kit.WAN_FFN_PATHS)
    record = session.execution_report()["plugins"]["selective_fp8"]["model"]["requests"]["r1"]
    assert record["modules"] == {**{p: {"fp8_gemm": 1} for p in kit.WAN_FFN_PATHS},
                                 **{f"blocks.{i}.ffn": {FUSED_KIND: 1} for i in (0, 1)}}
    assert record["fallbacks"] == {} and QUANT_REFERENCE_COUNTER not in record["counters"]
    assert GELU_REFERENCE_COUNTER not in record["counters"]
    rel = ((out - dense).norm() / dense.norm()).item()
    assert 0 < rel < 0.05, rel
    session.uninstall()
    assert torch.equal(run(model).float(), dense)


def test_min_tokens_fallback_on_gpu(kit):
    model = build(kit)
    session = install_diffusion_accelerations(model, {"selective_fp8": {"min_tokens": 100_000}},
                                              RuntimePolicy(device="cuda", dtype="bf16"), registry=registry())
    with CountScaledMM() as counter:
        run(model, "small")
    assert counter.calls == 0
    record = session.execution_report()["plugins"]["selective_fp8"]["model"]["requests"]["small"]
    assert record["fallbacks"] == {"fewer than min_tokens rows": len(kit.WAN_FFN_PATHS)}
    session.uninstall()


@pytest.mark.parametrize(("k", "n"), [(1536, 8960), (8960, 1536)])
def test_rel_l2_of_each_fp8_linear_vs_bf16_at_wan_1_3b_shapes(k, n):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(k, n)).to("cuda", torch.bfloat16).eval()
    x = torch.randn(4099, k, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        dense = model(x).float()
        exact = x.double() @ model[0].weight.double().t() + model[0].bias.double()
    session = install_diffusion_accelerations(model, {"selective_fp8": {"include": ["0"], "min_tokens": 1}},
                                              RuntimePolicy(device="cuda", dtype="bf16"), registry=registry())
    with torch.inference_mode(), CountScaledMM() as counter:
        fp8 = model(x).float()
    assert counter.calls == 1
    rel_vs_bf16 = ((fp8 - dense).norm() / dense.norm()).item()
    rel_vs_exact = ((fp8.double() - exact).norm() / exact.norm()).item()
    assert rel_vs_bf16 < 0.06 and rel_vs_exact < 0.06, (rel_vs_bf16, rel_vs_exact)
    session.uninstall()


def test_fused_gelu_producer_matches_the_per_linear_fp8_path(kit):
    model = build(kit)
    dense = run(model).float()
    outputs = {}
    for fuse in (False, True):
        session = install_diffusion_accelerations(
            model, {"selective_fp8": {"min_tokens": 128, "fuse_gelu": fuse}},
            RuntimePolicy(device="cuda", dtype="bf16"), registry=registry())
        with CountScaledMM() as counter:
            outputs[fuse] = run(model, f"fuse-{fuse}").float()
        assert counter.calls == len(kit.WAN_FFN_PATHS)  # fused or not: one _scaled_mm per selected Linear
        record = session.execution_report()["plugins"]["selective_fp8"]["model"]["requests"][f"fuse-{fuse}"]
        assert record["counters"].get(FUSED_KIND, 0) == (2 if fuse else 0)
        session.uninstall()
    # equal when the kernel's GELU equals torch's CUDA GELU bitwise (tests/core/.../test_fp8_gelu_quant_gpu.py)
    same = (outputs[True] == outputs[False]).double().mean().item()
    rel = ((outputs[True] - outputs[False]).norm() / outputs[False].norm()).item()
    assert rel < 1e-2, (rel, same)
    assert ((outputs[True] - dense).norm() / dense.norm()).item() < 0.05
