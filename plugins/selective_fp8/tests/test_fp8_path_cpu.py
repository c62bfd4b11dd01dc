"""The FP8 execution path of the installed plugin, run on the CPU.

The plugin never chooses FP8 on the CPU by itself (the receipt says "cpu device"). CPU builds of torch 2.13
implement a rowwise ``torch._scaled_mm``, so these tests let the runtime run FP8 on the CPU where its capability
probe passes (``runtime.allow_device``) and exercise the real path: activation quantization (the torch
reference, reported as such), ``torch._scaled_mm``, bias, receipts, clipping notes, the remaining fallback
reasons, and exact restore after FP8 ran. Where the probe fails (the CUDA build of torch 2.11 has only
per-tensor scales on the CPU) the visible fallback with the probe's reason is checked instead and the test is
skipped; the probe's own tests at the end run in both worlds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from worldfoundry_selective_fp8.plugin import prepare
from worldfoundry_selective_fp8.ffn_fusion import FUSED_KIND, GELU_REFERENCE_COUNTER
from worldfoundry_selective_fp8.runtime import QUANT_REFERENCE_COUNTER

from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.kernels.dispatch import quantize_activations_rowwise_fp8
from worldfoundry.core.acceleration.quantization.fp8_linear import (
    FP8_MIN_CAPABILITY,
    fp8_linear_fallback_reason,
    fp8_rowwise_linear_reference,
    quantize_weight_rowwise_fp8,
    rowwise_scaled_mm_unavailable_reason,
    scaled_mm_rowwise,
)
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy

CPU = torch.device("cpu")


def install(model: nn.Module, **options):
    reg = AccelerationRegistry(discover=False)
    reg.register("selective_fp8", prepare)
    session = install_diffusion_accelerations(model, {"selective_fp8": {"min_tokens": 1, **options}},
                                              RuntimePolicy(dtype="bf16"), registry=reg)
    return session, session.handles("selective_fp8")["model"]


def install_forced(kit, model: nn.Module, **options):
    """Install and let FP8 run on the CPU (skips the test, after checking the visible fallback, where it cannot)."""
    session, handle = install(model, **options)
    kit.allow_cpu_fp8(session, handle)
    return session, handle


def record_of(session, request_id: str) -> dict:
    return session.execution_report()["plugins"]["selective_fp8"]["model"]["requests"][request_id]


def test_fp8_path_runs_every_selected_linear_and_stays_close_to_dense(kit):
    model = kit.build_wan(dtype=torch.bfloat16)
    dense = kit.run_wan(model, torch.bfloat16).float()
    session, _ = install_forced(kit, model)
    with request_scope(RequestContext("r1")):
        out = kit.run_wan(model, torch.bfloat16).float()
    record = record_of(session, "r1")
    fused = {f"blocks.{i}.ffn": {FUSED_KIND: 1} for i in (0, 1)}  # GELU + down-projection quant fused per FFN
    assert record["modules"] == {**{p: {"fp8_gemm": 1} for p in kit.WAN_FFN_PATHS}, **fused}
    assert record["fallbacks"] == {}
    # the CPU used the torch references: the plain quantizer for the up projections, GELU + quantizer for the down
    assert record["counters"][QUANT_REFERENCE_COUNTER] == 2
    assert record["counters"][GELU_REFERENCE_COUNTER] == 2
    assert record["claimed_not_executed"] == []
    rel = ((out - dense).norm() / dense.norm()).item()
    assert 0 < rel < 0.05, rel  # approximate, and within the FP8 budget for random weights
    session.uninstall()


def test_each_linear_equals_the_reference_linear(kit):
    model = kit.build_wan(dtype=torch.bfloat16)
    session, handle = install_forced(kit, model)
    g = torch.Generator().manual_seed(5)
    for path in kit.WAN_FFN_PATHS:
        linear = model.get_submodule(path)
        x = torch.randn(3, 7, linear.in_features, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            y = linear(x)
        target = handle.runtime.targets[path]
        ref = fp8_rowwise_linear_reference(x, target.weight, linear.bias)
        pre_bias = fp8_rowwise_linear_reference(x, target.weight)
        assert y.dtype == torch.bfloat16 and y.shape == (3, 7, linear.out_features)
        assert torch.all((y.float() - ref).abs() <= (pre_bias.abs() + ref.abs()) * 2.0**-8 + 1e-4)
        with torch.no_grad():
            dense = nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        assert ((y.float() - dense).norm() / dense.norm()).item() < 0.06
    session.uninstall()


def test_remaining_fallback_reasons(kit):
    model = kit.build_wan(dtype=torch.float32)
    session, _ = install_forced(kit, model)
    with request_scope(RequestContext("fp32")):
        kit.run_wan(model)
    assert record_of(session, "fp32")["fallbacks"] == {"dtype not bfloat16": 4}
    session.uninstall()

    model = kit.build_wan(dtype=torch.bfloat16)
    session, _ = install_forced(kit, model, min_tokens=10_000)
    with request_scope(RequestContext("small")):
        kit.run_wan(model, torch.bfloat16)
    assert record_of(session, "small")["fallbacks"] == {"fewer than min_tokens rows": 4}
    session.uninstall()

    session, _ = install_forced(kit, model)
    linear = model.blocks[0].ffn.net[2]
    with request_scope(RequestContext("grad")):
        linear(torch.randn(4, 128, dtype=torch.bfloat16))  # grad mode on and the weight requires grad
        with torch.no_grad():
            linear(torch.randn(4, 128, dtype=torch.bfloat16))
    record = record_of(session, "grad")
    assert record["module_fallbacks"] == {"blocks.0.ffn.net.2": {"autograd enabled": 1}}
    assert record["modules"] == {"blocks.0.ffn.net.2": {"fp8_gemm": 1}}
    session.uninstall()


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_clipped_activations_are_noted_per_request(kit):
    model = kit.build_wan(dtype=torch.bfloat16)
    session, handle = install_forced(kit, model)
    guard = attach_request_guard(model)
    linear = model.blocks[1].ffn.net[0].proj
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    x[2, 3] = float("inf")
    with guard.request("clip"), request_scope(RequestContext("clip")), torch.no_grad():
        linear(x)  # one non-finite element: inf / inf -> nan after scaling
    record = record_of(session, "clip")
    assert record["notes"]["activation_clipped_elements"] == 1
    assert record["notes"]["activation_clipped_by_module"] == {"blocks.1.ffn.net.0.proj": 1}
    with guard.request("clean"), request_scope(RequestContext("clean")), torch.no_grad():
        linear(torch.randn(5, 64, dtype=torch.bfloat16))
    assert record_of(session, "clean")["notes"]["activation_clipped_elements"] == 0
    report = session.execution_report()["plugins"]["selective_fp8"]["model"]["selective_fp8"]
    assert report["activation_clipping"]["elements_total"] == 1
    session.uninstall()


def test_exact_restore_after_the_fp8_path_ran(kit):
    model = kit.build_wan(dtype=torch.bfloat16)
    before = kit.fingerprint(model)
    session, _ = install_forced(kit, model)
    assert not torch.equal(kit.run_wan(model, torch.bfloat16), before.output)  # FP8 really ran
    session.uninstall()
    kit.assert_same(before, kit.fingerprint(model))


# ------------------------------------------------------------------------------------------ the capability probe
def test_the_probe_verdict_matches_what_the_real_call_does():
    verdict = rowwise_scaled_mm_unavailable_reason(CPU)
    assert rowwise_scaled_mm_unavailable_reason(CPU) is verdict  # cached
    weight = quantize_weight_rowwise_fp8(torch.randn(32, 64))
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    rows = quantize_activations_rowwise_fp8(x, backend="torch")
    bias = torch.randn(32, dtype=torch.bfloat16)
    try:
        out = scaled_mm_rowwise(rows.q, rows.scale, weight, bias)
    except Exception as exc:  # this build has no rowwise CPU kernel: the probe must have said so
        assert verdict is not None and verdict.startswith("rowwise torch._scaled_mm unavailable on cpu"), (verdict, exc)
    else:
        assert verdict is None
        ref = fp8_rowwise_linear_reference(x, weight, bias)
        assert torch.allclose(out.float(), ref, rtol=2.0**-7, atol=1e-3)


def test_probe_of_a_device_this_process_cannot_use_reports_why():
    verdict = rowwise_scaled_mm_unavailable_reason(torch.device("cuda"))
    usable = torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY
    if usable:
        assert verdict is None
    else:
        assert verdict is not None and verdict.startswith("rowwise torch._scaled_mm unavailable on cuda: ")
        assert "\n" not in verdict and len(verdict) < 240  # one line, bounded: it goes into receipts


def test_the_policy_never_chooses_fp8_on_the_cpu_and_allow_device_returns_the_verdict(kit):
    assert fp8_linear_fallback_reason(CPU) == "cpu device"
    model = kit.build_wan(dtype=torch.bfloat16)
    session, handle = install(model)
    assert handle.runtime.device_reasons == {CPU: "cpu device"}  # decided at activation, from the weights' device
    assert handle.runtime.allow_device(CPU) == rowwise_scaled_mm_unavailable_reason(CPU)
    session.uninstall()


def test_a_failed_probe_is_a_visible_fallback_and_runs_dense_bitwise(kit):
    model = kit.build_wan(dtype=torch.bfloat16)
    dense = kit.run_wan(model, torch.bfloat16)
    session, handle = install(model)
    reason = "rowwise torch._scaled_mm unavailable on cpu: only per-tensor scaling"
    handle.runtime.device_reasons[CPU] = reason  # the verdict a build without the rowwise CPU kernel gets
    with request_scope(RequestContext("no-kernel")):
        out = kit.run_wan(model, torch.bfloat16)
    record = record_of(session, "no-kernel")
    assert record["module_fallbacks"] == {p: {reason: 1} for p in kit.WAN_FFN_PATHS}
    assert record["modules"] == {}
    assert torch.equal(out, dense)
    session.uninstall()
