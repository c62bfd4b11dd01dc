"""Triton SVDQuant kernels against their torch references (CPU, ``TRITON_INTERPRET=1``, small shapes).

Claims:

* per-token INT8 activation quantization (with and without smoothing): codes and scales **bitwise** equal to
  :func:`quantize_rows_int8` (the interpreter runs the same float32 operations; the kernel launches without
  FMA contraction);
* W4A8 GEMM (both tile orientations, rank 0 and padded rank, bias or not, group 64/128, row tails): float32
  output within ``1e-5 * max|ref|`` of :func:`w4a8_linear_reference` (integer partial sums exact in both; only
  the low-rank dot's summation order differs); bfloat16 output within one bfloat16 ulp of ``max|ref|``
  (``2**-7 * max|ref|``);
* per-channel W4A8 GEMM (``group_size = 0``; both orientations, ``BLOCK_K`` 128 and 256): the residual part (rank 0, no
  bias, float32 output) **bitwise** :func:`int4_gemm_reference` (one exact int32 sum, the same float32 rounding and
  products); with low-rank and bias within ``1e-5 * max|ref|`` (float32) / one bfloat16 ulp of ``max|ref|``;
* W4A16 GEMM: within ``2**-5 * max|ref|`` of :func:`w4a16_linear_reference` here -- the interpreter's
  float32 -> bfloat16 conversion of the dequantized operands does not round to nearest even; the GPU test
  holds it to ``2**-7``.
"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.kernels.int8_act_quant import (
    TRITON_AVAILABLE,
    interpreter_enabled,
    triton_quantize_rows_int8,
)
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import lowrank_down, pad_rank, svdquant_linear
from worldfoundry.core.acceleration.kernels.w4a8_gemm import triton_w4a8_gemm, triton_w4a16_gemm
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8
from worldfoundry.errors import QuantizationInputError
from worldfoundry.core.acceleration.quantization.svdquant_numerics import (
    SVDQuantWeight,
    decompose,
    int4_gemm_reference,
    w4a8_linear_reference,
    w4a16_linear_reference,
)

pytestmark = pytest.mark.skipif(
    not (TRITON_AVAILABLE and interpreter_enabled()), reason="needs triton with TRITON_INTERPRET=1")


def _weight(n: int, k: int, rank: int, group: int, smooth: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    amax = (torch.rand(k, generator=g) * 4 + 0.1) if smooth else None
    return pad_rank(decompose(w, rank=rank, group_size=group, act_absmax=amax))


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("shape", [(5, 64), (13, 200), (4, 1536), (3, 8960)])  # 1, 3, 2, 3 row pieces
def test_int8_activation_kernel_is_bitwise_the_reference(shape, smooth):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    x[1] = 0.0  # an all-zero row: codes 0, floor scale
    inv = (torch.rand(shape[1], generator=g) + 0.5) if smooth else None
    q_ref, s_ref = quantize_rows_int8(x, inv)
    for single_pass in (False, True):
        q, s = triton_quantize_rows_int8(x, inv, single_pass=single_pass)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert int(q.abs().max()) == 127


def test_int8_codes_round_ties_to_even_and_clamp_like_the_reference():
    """Rows whose maximum is 127 (so ``127 / max`` is exactly 1): ties round to even, both signs, at every
    magnitude up to the clamp; the kernel's codes (the float's low mantissa byte after adding 1.5 * 2**23) equal
    the reference's."""
    halves = torch.arange(-127.0, 127.5, 0.5)
    x = torch.stack([torch.cat([halves, torch.tensor([127.0])]), torch.cat([-halves, torch.tensor([-127.0])])])
    q, s = triton_quantize_rows_int8(x, None)
    q_ref, s_ref = quantize_rows_int8(x, None)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    at = {float(v): int(c) for v, c in zip(halves, q[0, :-1])}
    assert [at[v] for v in (0.5, 1.5, 2.5, -0.5, -1.5, -125.5, 126.5)] == [0, 2, 2, 0, -2, -126, 126]
    assert int(q.abs().max()) == 127


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("rank,bias,group,m", [(0, False, 64, 32), (8, True, 64, 40), (32, True, 128, 17)])
def test_w4a8_gemm_matches_the_reference(swap, rank, bias, group, m):
    n, k = 48, 256
    weight = _weight(n, k, rank, group, smooth=rank > 0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    q, s = quantize_rows_int8(x, weight.inv_smooth)
    t = lowrank_down(x, weight)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 2, "SWAP_AB": swap}
    out = triton_w4a8_gemm(q, s, weight, t, b, out_dtype=torch.float32, config=cfg)
    ref = w4a8_linear_reference(x, weight, b)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    out_bf16 = triton_w4a8_gemm(q, s, weight, t, b, out_dtype=torch.bfloat16, config=cfg)
    assert (out_bf16.float() - ref).abs().max() <= 2**-7 * ref.abs().max()


@pytest.mark.parametrize("swap,block_k", [(False, 128), (True, 128), (True, 256)])
@pytest.mark.parametrize("rank,bias,m", [(0, False, 32), (32, True, 45)])
def test_per_channel_w4a8_gemm_matches_the_reference(swap, block_k, rank, bias, m):
    n, k = 40, 512
    weight = _weight(n, k, rank, 0, smooth=rank > 0, seed=4)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(m, k, generator=g) * 2
    b = torch.randn(n, generator=g) if bias else None
    q, s = quantize_rows_int8(x, weight.inv_smooth)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 2, "SWAP_AB": swap, "BLOCK_K": block_k}
    residual = SVDQuantWeight(weight.qweight, weight.scales, 0, weight.inv_smooth)
    out0 = triton_w4a8_gemm(q, s, residual, None, None, out_dtype=torch.float32, config=cfg)
    assert torch.equal(out0, int4_gemm_reference(q, s, residual))
    out = triton_w4a8_gemm(q, s, weight, lowrank_down(x, weight), b, out_dtype=torch.float32, config=cfg)
    ref = w4a8_linear_reference(x, weight, b)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    # the separate low-rank GEMM computes t as the reference does (the fused kernel's float32 sum rounds t
    # differently; its tolerance is test_int8_quant_lowrank's)
    y, used = svdquant_linear(x.to(torch.bfloat16), weight, b, backend="w4a8", fused_lowrank=False)
    ref16 = w4a8_linear_reference(x.to(torch.bfloat16), weight, b).float()
    assert used.backend == "w4a8" and (y.float() - ref16).abs().max() <= 2**-7 * ref16.abs().max()


def test_per_channel_gemm_refuses_k_it_cannot_sum_exactly():
    from worldfoundry.core.acceleration.kernels.w4a8_channel_gemm import MAX_CHANNEL_K, check_channel_k

    check_channel_k(MAX_CHANNEL_K)
    with pytest.raises(QuantizationInputError, match="exceeds 131072"):
        check_channel_k(MAX_CHANNEL_K + 128)
    with pytest.raises(QuantizationInputError, match="not a multiple of the K step 256"):
        check_channel_k(384, block_k=256)


@pytest.mark.parametrize("rank,group", [(0, 64), (16, 128), (16, 0)])
def test_w4a16_gemm_matches_the_reference(rank, group):
    n, k, m = 64, 256, 24
    weight = _weight(n, k, rank, group, smooth=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    out = triton_w4a16_gemm(x, weight, lowrank_down(x, weight), b)
    ref = w4a16_linear_reference(x, weight, b)
    assert (out.float() - ref.float()).abs().max() <= 2**-5 * ref.float().abs().max()


def test_dispatch_runs_the_requested_kernel_under_the_interpreter_and_the_reference_on_auto():
    weight = _weight(32, 128, 8, 64, smooth=True)
    x = torch.randn(2, 9, 128)
    y, used = svdquant_linear(x, weight, None, backend="w4a8", fused_lowrank=False)
    assert used.backend == "w4a8" and used.reason is None and y.shape == (2, 9, 32)
    y_auto, auto = svdquant_linear(x, weight, None)
    assert auto.backend == "reference" and auto.reason == "cpu device"
    assert (y - y_auto).abs().max() <= 1e-5 * y_auto.abs().max()
    # quantizer and low-rank down projection in one kernel: t rounds to bfloat16 from another float32 sum
    y_fused, used = svdquant_linear(x, weight, None, backend="w4a8", fused_lowrank=True)
    assert used.backend == "w4a8" and (y_fused - y_auto).abs().max() <= 2**-7 * y_auto.abs().max()


@pytest.mark.parametrize("outcome", ["runs", "refuses"])
def test_w4a8_on_hopper_routes_per_channel_weights_to_the_gluon_gemm(monkeypatch, outcome):
    """The dispatch logic (the Gluon kernel itself is tested on the GPU): per-channel weights on a Hopper device go
    to the persistent Gluon GEMM, recorded as ``w4a8_gluon``; a refusal runs the Triton GEMM and names why."""
    from worldfoundry.core.acceleration.kernels import svdquant_dispatch as dispatch

    weight = _weight(32, 128, 8, 0, smooth=False)
    x = torch.randn(5, 128)
    q, s = quantize_rows_int8(x, weight.inv_smooth)
    t = lowrank_down(x, weight)
    calls = []
    assert not dispatch._hopper(torch.device("cpu"))

    def fake_gemm(*args, **kwargs):
        calls.append(args)
        if outcome == "refuses":
            raise QuantizationInputError("gluon_w4a8_persistent_gemm: N = 30 must be a multiple of 8 (TMA store)")
        return torch.ones(5, 32, dtype=torch.bfloat16)

    monkeypatch.setattr(dispatch, "_hopper", lambda device: True)
    monkeypatch.setattr(dispatch, "GLUON_AVAILABLE", True)
    monkeypatch.setattr(dispatch, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(dispatch, "gluon_w4a8_persistent_gemm", fake_gemm)
    monkeypatch.setattr(dispatch, "triton_w4a8_gemm", lambda *a, **k: torch.zeros(5, 32, dtype=k["out_dtype"]))
    out, used = dispatch.w4a8_gemm_from_codes(q, s, weight, t, None, torch.float32, dispatch.BackendChoice("w4a8"))
    assert len(calls) == 1 and out.dtype == torch.float32
    if outcome == "runs":
        assert used == dispatch.BackendChoice(dispatch.W4A8_GLUON) and torch.equal(out, torch.ones(5, 32))
    else:
        assert used.backend == "w4a8" and used.reason.startswith("gluon w4a8 refused: gluon_w4a8_persistent_gemm: N")
        assert torch.equal(out, torch.zeros(5, 32))
    grouped = _weight(32, 128, 8, 64, smooth=False)  # group-wise scales never go to the per-channel Gluon GEMM
    _, used = dispatch.w4a8_gemm_from_codes(q, s, grouped, t, None, torch.float32,
                                            dispatch.BackendChoice("w4a8", "kept"))
    assert used == dispatch.BackendChoice("w4a8", "kept") and len(calls) == 1


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("w_group,group,rank,bias,m", [
    (64, 64, 0, False, 32), (64, 64, 16, True, 40), (128, 128, 32, True, 17),  # one activation group per weight group
    (0, 128, 0, False, 32), (0, 256, 16, True, 37), (0, 128, 32, False, 9),  # per channel: one per K step
])
def test_w4a8_gemm_with_activation_scales_per_group(swap, w_group, group, rank, bias, m):
    from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8_grouped
    from worldfoundry.core.acceleration.quantization.svdquant_numerics import int4_gemm_reference_grouped

    n, k = (48, 256) if w_group else (40, 512)
    weight = _weight(n, k, rank, w_group, smooth=rank > 0, seed=2)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, k)
    b = torch.randn(n, generator=g) if bias else None
    q, s = quantize_rows_int8_grouped(x, weight.inv_smooth, group)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 2, "SWAP_AB": swap}
    if not w_group:
        cfg["BLOCK_K"] = 128  # the per-channel step follows the activation group
    residual = SVDQuantWeight(weight.qweight, weight.scales, w_group, weight.inv_smooth)
    out0 = triton_w4a8_gemm(q, s, residual, None, None, out_dtype=torch.float32, config=cfg)
    assert torch.equal(out0, int4_gemm_reference_grouped(q, s, residual))  # the integer part, bitwise
    t = lowrank_down(x, weight) if rank else None
    out = triton_w4a8_gemm(q, s, weight, t, b, out_dtype=torch.float32, config=cfg)
    ref = w4a8_linear_reference(x, weight, b, act_group=group)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_w4a8_gemm_refuses_activation_groups_it_does_not_take():
    from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8_grouped

    x = torch.randn(8, 256)
    grouped = _weight(16, 256, 0, 64, smooth=False)
    q, s = quantize_rows_int8_grouped(x, None, 128)  # groups of 128 against weight groups of 64
    with pytest.raises(QuantizationInputError, match=r"one per token and weight group \(\[8, 4\]\); got \(8, 2\)"):
        triton_w4a8_gemm(q, s, grouped, None, None)
    channel = _weight(16, 256, 0, 0, smooth=False)
    q, s = quantize_rows_int8_grouped(x, None, 64)  # per channel: the K step is 128 or 256
    with pytest.raises(QuantizationInputError, match="groups of 128 or 256 input features with per-channel"):
        triton_w4a8_gemm(q, s, channel, None, None)
