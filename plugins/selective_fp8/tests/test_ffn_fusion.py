"""The fused GELU producer of ``selective_fp8`` on the CPU (tiny Wan and bare diffusers FeedForwards).

Covers: which FFNs are fused (both Linears selected, diffusers GELU tanh/none, plain dropouts), the claims and
notes, the execution receipts of the fused path (forced onto the CPU's ``torch._scaled_mm``, torch references
for the quantizers), bitwise equality with the per-Linear FP8 path, the dense fallbacks that keep the original
FFN forward, hooks (not fused at install; a call with hooks added later runs unfused and is counted), active
dropout, extra arguments, and exact restore.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
from diffusers.models.attention import FeedForward
from worldfoundry_selective_fp8.ffn_fusion import (
    FUSED_KIND,
    GELU_REFERENCE_COUNTER,
    SKIP_APPROXIMATE,
    SKIP_ARGUMENTS,
    SKIP_DROPOUT,
    SKIP_HOOKS,
    plan_ffn_fusion,
)
from worldfoundry_selective_fp8.plugin import prepare

from worldfoundry.base_models.diffusion_model.optimizations.plugins import (
    install_diffusion_accelerations,
)
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy

FFNS = ["blocks.0.ffn", "blocks.1.ffn"]


def install(kit, model: nn.Module, *, force_fp8: bool = True, **options):
    """Install; with ``force_fp8`` let FP8 run on the CPU where the capability probe passes (elsewhere the
    visible fallback is checked and the test skipped, see ``conftest.allow_cpu_fp8``)."""
    reg = AccelerationRegistry(discover=False)
    reg.register("selective_fp8", prepare)
    session = install_diffusion_accelerations(model, {"selective_fp8": {"min_tokens": 1, **options}},
                                              RuntimePolicy(dtype="bf16"), registry=reg)
    handle = session.handles("selective_fp8")["model"]
    if force_fp8:
        kit.allow_cpu_fp8(session, handle)
    return session, handle


def record_of(session, request_id: str) -> dict:
    return session.execution_report()["plugins"]["selective_fp8"]["model"]["requests"][request_id]


def run(kit, model, request_id: str) -> torch.Tensor:
    with request_scope(RequestContext(request_id)):
        return kit.run_wan(model, torch.bfloat16)


# ------------------------------------------------------------------------------------------ planning
def test_plan_needs_both_linears_of_a_gelu_feedforward(kit):
    model = kit.build_wan()
    fused, not_fused = plan_ffn_fusion(model, kit.WAN_FFN_PATHS)
    assert [f.path for f in fused] == FFNS and not_fused == {}
    assert (fused[0].up_path, fused[0].down_path, fused[0].approximate) == (
        "blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2", "tanh")
    fused, not_fused = plan_ffn_fusion(model, ["blocks.0.ffn.net.2", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2"])
    assert [f.path for f in fused] == ["blocks.1.ffn"] and not_fused == {}  # blocks.0 has one Linear: no candidate
    fused, not_fused = plan_ffn_fusion(model, kit.WAN_FFN_PATHS, enabled=False)
    assert fused == [] and not_fused == dict.fromkeys(FFNS, "fuse_gelu is false")


def test_swiglu_ffn_of_minimax_h3_is_not_fused_and_says_why(kit):
    model = kit.build_minimax_h3()
    plan = prepare(model, {}, RuntimePolicy())
    assert not any(c.endswith(".ff") for c in plan.claims)
    note = next(n for n in plan.notes if "FFN(s)" in n)
    assert note.startswith("0 FFN(s) run GELU") and "net.0 is SwiGLU; only diffusers' GELU is fused" in note


@pytest.mark.parametrize("where", ["net.0", "net.1"])
def test_hooks_on_inner_modules_at_install_keep_that_ffn_unfused(kit, where):
    model = kit.build_wan(dtype=torch.bfloat16)
    calls = []
    model.blocks[0].ffn.get_submodule(where).register_forward_hook(lambda m, a, o: calls.append(where))
    session, handle = install(kit, model)
    assert handle.runtime.fused_ffns == ("blocks.1.ffn",)
    assert "blocks.0.ffn" not in session.receipt.plugins[0].claims
    assert handle.runtime.not_fused == {
        "blocks.0.ffn": f"blocks.0.ffn.{where} has forward hooks that the fused forward would bypass"}
    run(kit, model, "r1")
    record = record_of(session, "r1")
    assert calls == [where]  # the hook ran: blocks.0 took the per-Linear path
    assert record["modules"] == {**{p: {"fp8_gemm": 1} for p in kit.WAN_FFN_PATHS}, "blocks.1.ffn": {FUSED_KIND: 1}}
    session.uninstall()


def test_structure_that_is_not_a_plain_feedforward_is_not_fused(kit):
    model = kit.build_wan()
    model.blocks[0].ffn.net[1] = nn.ReLU()
    model.blocks[1].ffn.net[0].approximate = "erf?"
    fused, not_fused = plan_ffn_fusion(model, kit.WAN_FFN_PATHS)
    assert fused == []
    assert not_fused == {
        "blocks.0.ffn": "blocks.0.ffn.net.1 is ReLU; expected a plain Dropout or Identity",
        "blocks.1.ffn": "blocks.1.ffn.net.0 has GELU approximate='erf?'; fused: ['tanh', 'none']",
    }


# ------------------------------------------------------------------------------------------ execution
def test_fused_path_receipts_and_bitwise_equality_with_the_per_linear_path(kit):
    model = kit.build_wan(dtype=torch.bfloat16)
    session, _ = install(kit, model, fuse_gelu=False)
    per_linear = run(kit, model, "per-linear")
    assert record_of(session, "per-linear")["modules"] == {p: {"fp8_gemm": 1} for p in kit.WAN_FFN_PATHS}
    session.uninstall()

    session, _ = install(kit, model)
    fused = run(kit, model, "fused")
    record = record_of(session, "fused")
    assert record["modules"] == {**{p: {"fp8_gemm": 1} for p in kit.WAN_FFN_PATHS},
                                 **{f: {FUSED_KIND: 1} for f in FFNS}}
    assert record["counters"][FUSED_KIND] == 2 and record["counters"][GELU_REFERENCE_COUNTER] == 2
    assert record["fallbacks"] == {} and record["skipped"] == {} and record["claimed_not_executed"] == []
    # the same h, the same GELU (torch's, on the CPU), the same quantization: the same output
    assert torch.equal(fused, per_linear)
    report = session.execution_report()["plugins"]["selective_fp8"]["model"]["selective_fp8"]["fused_producer"]
    assert report["ffns"] == FFNS and report["kind"] == FUSED_KIND
    session.uninstall()


@pytest.mark.parametrize("activation_fn", ["gelu-approximate", "gelu"])
def test_bare_feedforward_at_the_root_both_gelu_forms(kit, activation_fn):
    torch.manual_seed(0)
    ffn = FeedForward(64, inner_dim=128, activation_fn=activation_fn).to(torch.bfloat16).eval()
    x = torch.randn(2, 24, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        dense = ffn(x)
    session, handle = install(kit, ffn, include=["net.0.proj", "net.2"])
    assert handle.runtime.fused_ffns == ("<root>",) and "<root>" in session.receipt.plugins[0].claims
    with torch.no_grad(), request_scope(RequestContext("r")):
        out = ffn(x)
    record = record_of(session, "r")
    assert record["modules"]["<root>"] == {FUSED_KIND: 1}
    approximate = "tanh" if activation_fn == "gelu-approximate" else "none"
    with torch.no_grad():
        h = handle.runtime.targets["net.0.proj"]
        up = handle.runtime.fp8_matmul(h, x.reshape(-1, 64))
        g = torch.nn.functional.gelu(up, approximate=approximate)
        expected = handle.runtime.fp8_matmul(handle.runtime.targets["net.2"], g).reshape(2, 24, 64)
    assert torch.equal(out, expected)
    assert ((out.float() - dense.float()).norm() / dense.float().norm()).item() < 0.08
    session.uninstall()
    with torch.no_grad():
        assert torch.equal(ffn(x), dense)


def test_dense_fallbacks_keep_the_original_ffn_forward(kit):
    model = kit.build_wan(dtype=torch.bfloat16)
    dense = kit.run_wan(model, torch.bfloat16)
    session, _ = install(kit, model, force_fp8=False)  # the CPU: every Linear falls back, nothing fused
    assert torch.equal(run(kit, model, "cpu"), dense)
    record = record_of(session, "cpu")
    assert record["module_fallbacks"] == {p: {"cpu device": 1} for p in kit.WAN_FFN_PATHS}
    assert record["modules"] == {} and record["skipped"] == {}
    assert sorted(record["claimed_not_executed"]) == sorted([*kit.WAN_FFN_PATHS, *FFNS])
    session.uninstall()

    session, _ = install(kit, model, min_tokens=10_000)
    run(kit, model, "small")
    record = record_of(session, "small")
    assert record["fallbacks"] == {"fewer than min_tokens rows": 4} and record["modules"] == {}
    session.uninstall()


def test_hooks_added_after_install_make_that_call_unfused(kit):
    model = kit.build_wan(dtype=torch.bfloat16)
    session, _ = install(kit, model)
    seen = []
    handle = model.blocks[0].ffn.net[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape))
    run(kit, model, "hooked")
    record = record_of(session, "hooked")
    assert len(seen) == 1  # the GELU module was called: the hook saw its input
    assert record["skipped"] == {SKIP_HOOKS: 1}
    assert record["modules"]["blocks.1.ffn"] == {FUSED_KIND: 1} and "blocks.0.ffn" not in record["modules"]
    assert record["modules"]["blocks.0.ffn.net.2"] == {"fp8_gemm": 1}  # per-Linear FP8 still ran
    handle.remove()
    run(kit, model, "clean")
    assert record_of(session, "clean")["modules"]["blocks.0.ffn"] == {FUSED_KIND: 1}
    session.uninstall()


def test_active_dropout_and_extra_arguments_run_unfused(kit):
    model = kit.build_wan(dtype=torch.bfloat16)
    session, _ = install(kit, model)
    dropout = model.blocks[1].ffn.net[1]
    dropout.p = 0.5
    dropout.train()  # not a guarded module (no selected Linear under it)
    run(kit, model, "dropout")
    assert record_of(session, "dropout")["skipped"] == {SKIP_DROPOUT: 1}
    dropout.eval()
    ffn = model.blocks[0].ffn
    with request_scope(RequestContext("args")), torch.no_grad(), pytest.warns(FutureWarning, match="scale"):
        ffn(torch.randn(1, 4, 64, dtype=torch.bfloat16), scale=1.0)
    assert record_of(session, "args")["skipped"] == {SKIP_ARGUMENTS: 1}
    ffn.net[0].approximate = "sigmoid?"  # changed after install: that FFN runs unfused (and torch then refuses)
    with request_scope(RequestContext("approx")), torch.no_grad(), pytest.raises(RuntimeError, match="approximat"):
        ffn(torch.randn(1, 4, 64, dtype=torch.bfloat16))
    assert record_of(session, "approx")["skipped"] == {SKIP_APPROXIMATE: 1}
    ffn.net[0].approximate = "tanh"
    session.uninstall()


def test_exact_restore_and_signature_with_fusion(kit):
    model = kit.build_wan(dtype=torch.bfloat16)
    before = kit.fingerprint(model)
    signature = inspect.signature(model.blocks[0].ffn.forward)
    session, _ = install(kit, model)
    assert "forward" in model.blocks[0].ffn.__dict__
    assert inspect.signature(model.blocks[0].ffn.forward) == signature
    run(kit, model, "r")
    assert record_of(session, "r")["counters"][FUSED_KIND] == 2
    session.uninstall()
    assert all("forward" not in model.get_submodule(f).__dict__ for f in FFNS)
    kit.assert_same(before, kit.fingerprint(model))
