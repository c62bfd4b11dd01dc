"""Per-channel ``svdquant`` on CUDA (``group_size = 0``): the int32 main-loop GEMM against its reference at W81 FFN
shapes, the tile choice, and the plugin's receipts. Skipped without CUDA.

Tolerances: the residual GEMM (rank 0, no bias, float32 output) **bitwise** equal to
:func:`~worldfoundry.core.acceleration.quantization.svdquant_numerics.int4_gemm_reference` (one exact int32 sum,
then the same float32 rounding and products); with the low-rank branch and bias within one bfloat16 ulp of the
reference's largest magnitude (``2**-7 * max|ref|``).
"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, triton_quantize_rows_int8
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import lowrank_down, pad_rank, svdquant_linear
from worldfoundry.core.acceleration.kernels.w4a8_channel_gemm import CHANNEL_CONFIGS
from worldfoundry.core.acceleration.kernels.w4a8_gemm import tile_key, triton_w4a8_gemm
from worldfoundry.core.acceleration.kernels.w4a8_tuning import chosen_config
from worldfoundry.core.acceleration.quantization.svdquant_numerics import (
    SVDQuantWeight,
    decompose,
    int4_gemm_reference,
    w4a8_linear_reference,
)
from worldfoundry.core.model_loading.policy import RuntimePolicy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE),
                                                  reason="needs CUDA and triton")]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.parametrize("k,n", [(1536, 8960), (8960, 1536)])
def test_per_channel_gemm_matches_the_reference_at_w81_ffn_shapes(k, n):
    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(32760, k, generator=g, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)
    sq = pad_rank(decompose(w, rank=32, group_size=0, act_absmax=x.float().abs().amax(0), svd="randomized"))
    q, s = triton_quantize_rows_int8(x, sq.inv_smooth)
    residual = SVDQuantWeight(sq.qweight, sq.scales, 0, sq.inv_smooth)
    exact = int4_gemm_reference(q, s, residual)
    for cfg in (CHANNEL_CONFIGS[0], CHANNEL_CONFIGS[2], CHANNEL_CONFIGS[-2]):  # swap k128, swap k256, no swap
        out = triton_w4a8_gemm(q, s, residual, None, None, out_dtype=torch.float32, config=cfg)
        assert torch.equal(out, exact), cfg
    t = lowrank_down(x, sq)
    ref = w4a8_linear_reference(x, sq, b).float()
    tuned = triton_w4a8_gemm(q, s, sq, t, b)
    assert (tuned.float() - ref).abs().max() <= 2**-7 * ref.abs().max()
    chosen = chosen_config(q.device, tile_key(sq, True, True, True), q.shape[0])
    assert chosen is not None and chosen in CHANNEL_CONFIGS
    y, used = svdquant_linear(x, sq, b)
    assert used.backend == ("w4f8" if HOPPER else "w4a16")  # per-channel weights run W4F8 on Hopper
    dense = torch.nn.functional.linear(x, w, b).float()
    # random weights, rank 32, per-channel INT4 residual: a broken kernel is far above this (not a quality claim)
    assert float((y.float() - dense).norm() / dense.norm()) < 0.2


@pytest.mark.parametrize("k,n", [(1536, 8960), (8960, 1536), (256, 512)])
def test_explicit_w4a8_runs_the_persistent_gluon_gemm_on_hopper(k, n):
    g = torch.Generator(device="cuda").manual_seed(3 * k + n)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(2, 16380 if k > 256 else 150, k, generator=g, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)
    sq = pad_rank(decompose(w, rank=32, group_size=0, svd="randomized"))
    y, used = svdquant_linear(x, sq, b, backend="w4a8")
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert used.backend == ("w4a8_gluon" if hopper else "w4a8") and used.reason is None
    assert y.shape == (*x.shape[:-1], n) and y.dtype == torch.bfloat16
    ref = w4a8_linear_reference(x, sq, b).float()
    assert (y.float() - ref).abs().max() <= 2**-7 * ref.abs().max()


def test_plugin_runs_a_per_channel_artifact_on_cuda(kit, tmp_path):
    model, artifact, reg, inputs, dense = kit.cuda_case(tmp_path, group_size=0, include=("blocks.*.ffn.2",))
    session = install_diffusion_accelerations(model, {"svdquant": {"artifact": str(artifact), "keep_original": "cpu"}},
                                              RuntimePolicy(device="cuda"), registry=reg)
    with request_scope(RequestContext("r1")), torch.inference_mode():
        out = model(**inputs, return_dict=False)[0]
    record = session.execution_report()["plugins"]["svdquant"]["model"]["requests"]["r1"]
    paths = ["blocks.0.ffn.net.2", "blocks.1.ffn.net.2"]
    targets = next(iter(session.handles("svdquant").values())).runtime.targets
    # per channel on Hopper: W4F8, unless its preparation refused these weights (then W4A8, reason counted)
    kinds = {p: ("w4a16" if not HOPPER else targets[p].backend) for p in paths}
    gluon = torch.cuda.get_device_capability()[0] == 9  # W4A8 on Hopper runs the persistent Gluon GEMM
    ran = {p: ("w4a8_gluon" if kinds[p] == "w4a8" and gluon else kinds[p]) for p in paths}
    assert record["modules"] == {p: {ran[p]: 1} for p in paths} and record["fallbacks"] == {}
    assert set(kinds.values()) <= ({"w4f8", "w4a8"} if HOPPER else {"w4a16"})
    assert float((out.float() - dense.float()).norm() / dense.float().norm()) < 0.05
    session.uninstall()
    with torch.inference_mode():
        assert torch.equal(model(**inputs, return_dict=False)[0], dense)


@pytest.mark.parametrize("k", [1536, 8960])
def test_fused_quant_lowrank_at_w81_widths(k):
    from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import triton_quantize_rows_int8_lowrank

    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(32760, k, generator=g, device="cuda").to(torch.bfloat16)
    inv = torch.rand(k, generator=g, device="cuda") + 0.5
    down = (torch.randn(32, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    q_ref, s_ref = triton_quantize_rows_int8(x, inv)
    t_ref = torch.nn.functional.linear(x, down).float()
    for rows in (16, 32, 64):
        q, s, t = triton_quantize_rows_int8_lowrank(x, inv, down, block_m=rows)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
        assert (t.float() - t_ref).abs().max() <= 2**-7 * t_ref.abs().max()
