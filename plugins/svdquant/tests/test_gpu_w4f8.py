"""The W4F8 backend of ``svdquant`` on CUDA (per-channel residual, FP8 activations, one ``torch._scaled_mm``).
Skipped without CUDA; the backend needs FP8 tensor cores (sm_89+).

Tolerances: ``torch._scaled_mm`` on the operands within 0.5 % (relative L2) of their float32 product, and the Linear
within 1 % of :func:`w4f8_linear_reference` with the low-rank branch on the codes (the head/tail low-rank codes
and FP8 accumulation); against bf16 a bound that catches a broken kernel (random weights: no quality claim).
"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import pad_rank, svdquant_linear
from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8
from worldfoundry.core.acceleration.quantization.int4_packing import unpack_int4
from worldfoundry.core.acceleration.quantization.int8_activation import smoothed_rows
from worldfoundry.core.acceleration.quantization.svdquant_numerics import decompose, w4f8_linear_reference
from worldfoundry.core.model_loading.policy import RuntimePolicy

FP8_TC = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (FP8_TC and TRITON_AVAILABLE),
                                                  reason="needs a CUDA GPU with FP8 tensor cores and triton")]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)

if TRITON_AVAILABLE:
    from worldfoundry.core.acceleration.kernels import w4f8_scaled_mm as sm


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _case(k: int, n: int, m: int = 4096, group: int = 0):
    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    x[:, :: max(1, k // 16)] *= 8.0
    b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16) * 0.01
    sq = pad_rank(decompose(w, rank=32, group_size=group, act_absmax=x.float().abs().amax(0), svd="randomized"))
    return w, x, b, sq


@pytest.mark.parametrize("k,n", [(1536, 8960), (8960, 1536)])
def test_operands_and_scaled_mm_on_the_gpu(k, n):
    w, x, b, sq = _case(k, n)
    prep = sm.prepare_scaled_mm(sq)
    a, s = sm.activation_operand(x, sq, prep)
    bw = sm.weight_operand(sq, prep)
    ref_q, ref_s = quantize_rowwise_fp8(smoothed_rows(x, sq.inv_smooth))
    assert torch.equal(a[:, :k].view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    step = torch.exp2(prep.exponents.float())[:, None]
    assert torch.equal(bw[:, :k].float() * step, unpack_int4(sq.qweight, 0).float())
    emulated = (a.float() @ bw.float().t()) * s * prep.scale_b
    for fast in (True, False):
        y = torch._scaled_mm(a, bw.t(), scale_a=s, scale_b=prep.scale_b, out_dtype=torch.bfloat16,
                             use_fast_accum=fast)
        assert _rel(y, emulated) < 5e-3
    ref = w4f8_linear_reference(x, sq, b, lowrank_from_codes=True).float()
    out = sm.scaled_mm_w4f8(x, sq, prep, b)
    assert _rel(out, ref) < 1e-2
    dense = torch.nn.functional.linear(x, w, b).float()
    assert _rel(out, dense) < 0.2  # measured 0.120 / 0.155 at M 32,760 on the H200


def test_dispatch_runs_w4f8_for_per_channel_and_w4a8_for_groups():
    _, x, b, sq = _case(512, 256, m=300)
    _, used = svdquant_linear(x, sq, b)
    assert used.backend == ("w4f8" if HOPPER else "w4a16")
    _, used = svdquant_linear(x, sq, b, backend="w4f8")
    assert used.backend == "w4f8" and used.reason is None
    _, x, b, grouped = _case(512, 256, m=300, group=128)
    _, used = svdquant_linear(x, grouped, b, backend="w4f8")
    assert used.backend == "w4a8" and "per output channel" in used.reason


def test_plugin_w4f8_receipts_memory_and_exact_restore(kit, tmp_path):
    # the tiny model's ffn.0 has 64 input features, below the per-channel K step (128): ffn.2 only
    model, artifact, reg, inputs, dense = kit.cuda_case(tmp_path, group_size=0, include=("blocks.*.ffn.2",))
    session = install_diffusion_accelerations(
        model, {"svdquant": {"artifact": str(artifact), "keep_original": "cpu", "backend": "w4f8"}},
        RuntimePolicy(device="cuda"), registry=reg)
    handle = next(iter(session.handles("svdquant").values()))
    with request_scope(RequestContext("r1")), torch.inference_mode():
        out = model(**inputs, return_dict=False)[0]
    record = session.execution_report()["plugins"]["svdquant"]["model"]["requests"]["r1"]
    for path, target in handle.runtime.targets.items():
        assert record["modules"][path] == {target.backend: 1}
        if target.backend == "w4f8":  # the bf16 low-rank pair left the device: the FP8 codes replace it
            assert target.weight.lora_up is None and target.scaled is not None
        else:
            assert any(key.startswith("backend_reason: w4f8 refused") for key in record.get("counters", {}))
    assert record["fallbacks"] == {}
    memory = handle.execution_report()["svdquant"]["memory"]
    assert memory["quantized_bytes"] == sum(t.weight.nbytes + (t.scaled.nbytes if t.scaled is not None else 0)
                                            for t in handle.runtime.targets.values())
    assert float((out.float() - dense.float()).norm() / dense.float().norm()) < 0.05
    session.uninstall()
    with torch.inference_mode():
        assert torch.equal(model(**inputs, return_dict=False)[0], dense)


def _wide_wan(kit):
    from worldfoundry import testing

    config = dict(kit.WAN_CONFIG, num_attention_heads=2, attention_head_dim=64, ffn_dim=256)
    return testing.tiny_wan(0, weight_scale=0.05, dtype=torch.bfloat16, **config).cuda()


@pytest.mark.skipif(not HOPPER, reason="W4F8 is the automatic backend on sm_90+")
@pytest.mark.parametrize("unsmoothed", [(), ("blocks.*.ffn.2",)], ids=["smoothed", "ffn2-unsmoothed"])
def test_fused_gelu_producer_runs_and_undoes(kit, tmp_path, unsmoothed):
    # dim 128, FFN 256: both FFN Linears take per-channel scales; unsmoothed, the producer skips 1/lambda
    model, artifact, reg, inputs, dense = kit.cuda_case(tmp_path, model=_wide_wan(kit), group_size=0,
                                                        unsmoothed=unsmoothed)
    outs = {}
    for fuse in (True, False):
        session = install_diffusion_accelerations(
            model, {"svdquant": {"artifact": str(artifact), "fuse_gelu": fuse}}, RuntimePolicy(device="cuda"),
            registry=reg)
        rid = f"r-{fuse}"
        with request_scope(RequestContext(rid)), torch.inference_mode():
            outs[fuse] = model(**inputs, return_dict=False)[0]
        record = session.execution_report()["plugins"]["svdquant"]["model"]["requests"][rid]
        targets = next(iter(session.handles("svdquant").values())).runtime.targets
        if all(t.backend == "w4f8" for t in targets.values()):
            for block in ("blocks.0.ffn", "blocks.1.ffn"):
                fused_kind = record["modules"].get(block, {})
                assert fused_kind == ({"w4f8_gelu_fused": 1} if fuse else {})
                assert record["modules"][f"{block}.net.2"] == {"w4f8": 1}
        session.uninstall()
        with torch.inference_mode():
            assert torch.equal(model(**inputs, return_dict=False)[0], dense)
    assert float((outs[True].float() - dense.float()).norm() / dense.float().norm()) < 0.05
    # the fused GELU rounds slightly differently from torch's; both quantize the same activations otherwise
    assert float((outs[True].float() - outs[False].float()).norm() / outs[False].float().norm()) < 0.01


@pytest.mark.parametrize("k,n", [(1536, 8960), (8960, 1536)])
def test_one_launch_operand_on_the_gpu(k, n):
    """Codes and scales bitwise the two-launch operand's; the appended codes within one e4m3 step of the head
    (the float32 dot sums may run in another order); the Linear within 1e-3 of the two-launch one."""
    _, x, b, sq = _case(k, n)
    prep = sm.prepare_scaled_mm(sq)
    a2, s2 = sm.activation_operand(x, sq, prep)
    a1, s1 = sm.activation_operand(x, sq, prep, one_launch=True)
    assert torch.equal(a1[:, :k].view(torch.uint8), a2[:, :k].view(torch.uint8)) and torch.equal(s1, s2)
    assert (a1[:, k:].float() - a2[:, k:].float()).abs().max() <= 2**-3 * a2[:, k:].float().abs().max()
    y1 = sm.scaled_mm_w4f8(x, sq, prep, b, one_launch=True)
    assert _rel(y1, sm.scaled_mm_w4f8(x, sq, prep, b)) < 1e-3


@pytest.mark.skipif(not HOPPER, reason="W4F8 is the automatic backend on sm_90+")
def test_one_launch_operand_option_through_the_plugin(kit, tmp_path):
    model, artifact, reg, inputs, dense = kit.cuda_case(tmp_path, model=_wide_wan(kit), group_size=0,
                                                        unsmoothed=("blocks.*.ffn.2",))
    outs = {}
    for one in (False, True):
        session = install_diffusion_accelerations(
            model, {"svdquant": {"artifact": str(artifact), "one_launch_operand": one}},
            RuntimePolicy(device="cuda"), registry=reg)
        with request_scope(RequestContext(f"r-{one}")), torch.inference_mode():
            outs[one] = model(**inputs, return_dict=False)[0]
        session.uninstall()
    assert _rel(outs[True], outs[False]) < 1e-3
    with torch.inference_mode():
        assert torch.equal(model(**inputs, return_dict=False)[0], dense)
