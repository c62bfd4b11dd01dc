"""``svdquant``'s W4A8 GELU producer on CUDA: the kernel at the W81 down projection's width (bitwise given its GELU)
and the fused FFN of the tiny bfloat16 Wan (receipts, closeness to the per-Linear path, exact restore).
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from worldfoundry_svdquant.ffn_fusion_w4a8 import FUSED_KIND_W4A8, SINGLE_PASS_KIND
from worldfoundry_svdquant.plugin import prepare

from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import triton_gelu_quantize_rowwise_fp8
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE
from worldfoundry.core.acceleration.kernels.int8_gelu_quant import (
    GELU_NEGATIVE_BOUND,
    triton_gelu_quantize_rows_int8_lowrank,
)
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8, quantize_rows_int8_with_max
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE),
                                                  reason="needs CUDA and triton")]


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("m,k", [(4100, 8960), (77, 1536)])
def test_producer_codes_bitwise_given_its_gelu(m, k, approximate):
    g = torch.Generator(device="cuda").manual_seed(m + k)
    h = (torch.randn(m, k, device="cuda", generator=g) * 2).to(torch.bfloat16)
    inv = torch.rand(k, device="cuda", generator=g) + 0.5
    down = (torch.randn(32, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    q, s, t = triton_gelu_quantize_rows_int8_lowrank(h, approximate, inv, down)
    act = triton_gelu_quantize_rowwise_fp8(h, approximate, return_activation=True)[2]
    q_ref, s_ref = quantize_rows_int8(act, inv)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    t_ref = (act.float() @ down.float().t()).to(torch.bfloat16).float()
    assert (t.float() - t_ref).abs().max() <= 2**-7 * t_ref.abs().max()


def _unfused_and_fused(kit, model, artifact):
    """Outputs and receipt records of the model with ``fuse_gelu`` off and on (each session uninstalled)."""
    outs, records = {}, {}
    for fuse in (False, True):
        reg = AccelerationRegistry(discover=False)
        reg.register("svdquant", prepare)
        session = install_diffusion_accelerations(
            model, {"svdquant": {"artifact": str(artifact), "backend": "w4a8", "fuse_gelu": fuse}},
            RuntimePolicy(device="cuda"), registry=reg)
        with request_scope(RequestContext("r1", branch="cond", step_index=0)):
            outs[fuse] = kit.run_wan(model, torch.bfloat16).float()
        records[fuse] = session.execution_report()["plugins"]["svdquant"]["model"]["requests"]["r1"]
        session.uninstall()
    return outs, records


def test_fused_ffn_on_cuda(kit, tmp_path):
    model = kit.build_wan(dtype=torch.bfloat16).cuda()
    artifact = kit.calibrate(model, tmp_path / "bf16.json")
    before = kit.fingerprint(model)
    outs, records = _unfused_and_fused(kit, model, artifact)
    assert records[True]["modules"]["blocks.0.ffn"] == {FUSED_KIND_W4A8: 1}
    assert records[True]["modules"]["blocks.0.ffn.net.2"] == {"w4a8": 1}
    assert "blocks.0.ffn" not in records[False]["modules"]
    assert float((outs[True] - outs[False]).norm() / outs[False].norm()) < 0.01
    kit.assert_same(before, kit.fingerprint(model))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("m,k", [(4100, 8960), (77, 1536)])
def test_single_pass_producer_bitwise_given_its_gelu_and_stable(m, k, approximate):
    """Row maxima given: codes and scales bitwise the quantizer's against ``max(GELU(hmax), bound)`` of the kernel's
    own GELU, and the same on every run (the default launch shape at the W81 width)."""
    g = torch.Generator(device="cuda").manual_seed(m + k + 1)
    h = (torch.randn(m, k, device="cuda", generator=g) * 2).to(torch.bfloat16)
    h[3] = -(h[3].abs())
    rm = h.amax(dim=1).float().clamp_min(0.0)
    down = (torch.randn(32, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    q, s, t = triton_gelu_quantize_rows_int8_lowrank(h, approximate, None, down, row_max=rm)
    act = triton_gelu_quantize_rowwise_fp8(h, approximate, return_activation=True)[2]
    top = triton_gelu_quantize_rowwise_fp8(rm.to(torch.bfloat16)[:, None], approximate, return_activation=True)[2]
    q_ref, s_ref = quantize_rows_int8_with_max(act.float(), top.float().clamp_min(GELU_NEGATIVE_BOUND))
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    t_ref = (act.float() @ down.float().t()).to(torch.bfloat16).float()
    assert (t.float() - t_ref).abs().max() <= 2**-7 * t_ref.abs().max()
    for _ in range(2):
        again = triton_gelu_quantize_rows_int8_lowrank(h, approximate, None, down, row_max=rm)
        assert all(torch.equal(a, b) for a, b in zip(again, (q, s, t)))
    # the default rounds two elements per bfloat16 conversion on CUDA: one at a time gives the same values
    single = triton_gelu_quantize_rows_int8_lowrank(h, approximate, None, down, row_max=rm, packed_rounding=False)
    assert all(torch.equal(a, b) for a, b in zip(single, (q, s, t)))


def test_fused_ffn_single_pass_on_cuda(kit, tmp_path):
    """An unsmoothed ``net.2``: the up projection hands the row maxima to the one-pass producer (the tiny model's
    64 features take group-wise weights, so the Triton GEMM and a reduction of its output; the Gluon epilogue is
    tested in ``test_w4a8_gluon_persistent.py``); receipts, closeness to the per-Linear path, exact restore."""
    model = kit.build_wan(dtype=torch.bfloat16).cuda()
    artifact = kit.calibrate(model, tmp_path / "bf16u.json", unsmoothed=("blocks.*.ffn.2",))
    before = kit.fingerprint(model)
    outs, records = _unfused_and_fused(kit, model, artifact)
    assert records[True]["modules"]["blocks.0.ffn"] == {FUSED_KIND_W4A8: 1, SINGLE_PASS_KIND: 1}
    assert float((outs[True] - outs[False]).norm() / outs[False].norm()) < 0.01
    kit.assert_same(before, kit.fingerprint(model))
