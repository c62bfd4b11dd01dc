"""The W4F8 pieces of ``svdquant`` against their torch references (CPU, ``TRITON_INTERPRET=1``, small shapes).

Claims:

* FP8 rowwise quantization with smoothing: codes and scales **bitwise** ``quantize_rowwise_fp8`` of the smoothed
  rows, also written into a wider buffer (``q_out`` / ``scale_out``);
* INT4 -> FP8 expansion: **exactly** the unpacked codes (per channel and both group sizes);
* the Triton W4F8 GEMM (expanded and in-register weights; per channel, group 64/128): bfloat16 output within one
  bfloat16 ulp of ``max|ref|`` (``2**-7``) of :func:`w4f8_linear_reference`;
* the codes low-rank projection: within ``2**-7 * max`` of the float32 product of the dequantized codes;
* the cuBLAS operands (``A``, ``B`` of :mod:`w4f8_scaled_mm`): the codes bitwise, the appended weight columns
  ``[u_h | u_h | u_t]``, the per-channel exponents exact; the float32 product of the operands (what
  ``torch._scaled_mm`` computes, checked on the GPU) within 0.5 % (relative L2) of the reference with the
  low-rank branch on the codes -- the head/tail split, not one FP8 code (about 10 % off);
* ``α = ||D̂||_1`` bounds every appended activation code by 448 (hypothesis over random rows);
* the one-launch activation operand (codes and appended codes together): bitwise the two-launch one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import launch_rowwise_fp8
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import choose_backend, lowrank_down, pad_rank
from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8
from worldfoundry.core.acceleration.quantization.int4_packing import unpack_int4
from worldfoundry.core.acceleration.quantization.int8_activation import smoothed_rows
from worldfoundry.core.acceleration.quantization.svdquant_numerics import decompose, w4f8_linear_reference
from worldfoundry.errors import QuantizationInputError

pytestmark = pytest.mark.skipif(
    not (TRITON_AVAILABLE and interpreter_enabled()), reason="needs triton with TRITON_INTERPRET=1")

if TRITON_AVAILABLE:
    from worldfoundry.core.acceleration.kernels import w4f8_gemm as g
    from worldfoundry.core.acceleration.kernels import w4f8_scaled_mm as sm


def _weight(n: int, k: int, group: int, rank: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    amax = torch.rand(k, generator=gen) * 4 + 0.1
    return pad_rank(decompose(w, rank=rank, group_size=group, act_absmax=amax)), w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_smoothed_fp8_quantization_is_bitwise_and_fills_a_wider_buffer():
    sq, _ = _weight(32, 256, 0)
    x = torch.randn(40, 256).to(torch.bfloat16)
    ref_q, ref_s = quantize_rowwise_fp8(smoothed_rows(x, sq.inv_smooth))
    q, s, _ = launch_rowwise_fp8(x, inv_smooth=sq.inv_smooth)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    wide = torch.zeros(40, 300, dtype=torch.float8_e4m3fn)
    scale = torch.empty(40, 1)
    q2, _, _ = launch_rowwise_fp8(x, inv_smooth=sq.inv_smooth, q_out=wide, scale_out=scale)
    assert torch.equal(wide[:, :256].view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_s)
    assert torch.equal(wide[:, 256:].float(), torch.zeros(40, 44)) and q2.shape == (40, 256)
    with pytest.raises(QuantizationInputError, match="inv_smooth must be float32"):
        launch_rowwise_fp8(x, inv_smooth=sq.inv_smooth[:10])
    with pytest.raises(QuantizationInputError, match="output buffer"):
        launch_rowwise_fp8(x, q_out=torch.zeros(40, 100, dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("group", [0, 64, 128])
def test_expansion_is_the_codes(group):
    sq, _ = _weight(48, 256, group)
    assert torch.equal(g.expand_int4_to_fp8(sq).float(), unpack_int4(sq.qweight, group).float())


@pytest.mark.parametrize("group", [0, 64, 128])
@pytest.mark.parametrize("expanded", [True, False])
def test_triton_w4f8_gemm_matches_the_reference(group, expanded):
    sq, _ = _weight(48, 256, group)
    x = torch.randn(40, 256).to(torch.bfloat16)
    b = torch.randn(48).to(torch.bfloat16)
    q, s, _ = launch_rowwise_fp8(x, inv_smooth=sq.inv_smooth)
    y = g.triton_w4f8_gemm(q, s, sq, lowrank_down(x, sq), b, expanded=expanded).float()
    ref = w4f8_linear_reference(x, sq, b).float()
    assert (y - ref).abs().max() <= 2**-7 * ref.abs().max()
    with pytest.raises(QuantizationInputError, match="q must be contiguous float8_e4m3fn"):
        g.triton_w4f8_gemm(q.float(), s, sq, None, None)


def test_codes_lowrank_projection():
    sq, _ = _weight(48, 256, 0)
    x = torch.randn(40, 256).to(torch.bfloat16)
    q, s, _ = launch_rowwise_fp8(x, inv_smooth=sq.inv_smooth)
    d_hat = g.lowrank_down_for_codes(sq)
    t = g.triton_codes_lowrank(q, s, d_hat).float()
    ref = (q.float() * s) @ d_hat.float().t()
    assert (t - ref).abs().max() <= 2**-7 * ref.abs().max()


@pytest.mark.parametrize("n,k", [(48, 256), (256, 1024)])
def test_cublas_operands(n, k):
    sq, _ = _weight(n, k, 0, rank=32)
    prep = sm.prepare_scaled_mm(sq)
    x = torch.randn(64, k).to(torch.bfloat16)
    a, s = sm.activation_operand(x, sq, prep)
    bw = sm.weight_operand(sq, prep)
    r = prep.rank
    assert a.shape == (64, k + 3 * r) and bw.shape == (n, k + 3 * r) and prep.extra == 3 * r
    ref_q, ref_s = quantize_rowwise_fp8(smoothed_rows(x, sq.inv_smooth))
    assert torch.equal(a[:, :k].view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    step = torch.exp2(prep.exponents.float())[:, None]
    assert torch.equal(bw[:, :k].float() * step, unpack_int4(sq.qweight, 0).float())
    assert torch.equal(prep.scale_b, sq.scales.float().reshape(1, -1) * step.t())
    head, tail = prep.up_codes[:, :r], prep.up_codes[:, r:]
    assert torch.equal(bw[:, k:].view(torch.uint8), torch.cat([head, head, tail], 1).view(torch.uint8))
    emulated = (a.float() @ bw.float().t()) * s * prep.scale_b
    ref = w4f8_linear_reference(x, sq, None, lowrank_from_codes=True).float()
    assert _rel(emulated, ref) < 5e-3
    # one FP8 code per low-rank term instead of the head/tail split: an order of magnitude further off
    single = a[:, k:k + r].float() @ bw[:, k:k + r].float().t()
    one_code = (a[:, :k].float() @ bw[:, :k].float().t() + single) * s * prep.scale_b
    assert _rel(one_code, ref) > 5 * _rel(emulated, ref)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), spike=st.floats(1.0, 50.0))
def test_alpha_bounds_every_appended_activation_code(seed, spike):
    sq, _ = _weight(32, 128, 0, rank=16, seed=seed % 7)
    prep = sm.prepare_scaled_mm(sq)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 128, generator=gen)
    x[:, seed % 128] *= spike
    a, s = sm.activation_operand(x.to(torch.bfloat16), sq, prep)
    exact = (a[:, :128].float() @ prep.down_hat.float().t()) / prep.alpha
    assert exact.abs().max() <= 448.0 * (1 + 2**-7)


def test_refusals_name_the_cause():
    grouped, _ = _weight(48, 256, 128)
    assert "per-channel" in sm.unsupported_reason(grouped)
    with pytest.raises(QuantizationInputError, match="per-channel scales"):
        sm.prepare_scaled_mm(grouped)
    sq, _ = _weight(48, 256, 0)
    huge = sq.__class__(**{**sq.__dict__, "lora_up": sq.lora_up * 2.0**20})
    with pytest.raises(QuantizationInputError, match="beyond 2\\*\\*9"):
        sm.prepare_scaled_mm(huge)


def test_backend_choice_off_cuda_runs_the_w4f8_reference():
    from worldfoundry.core.acceleration.kernels.svdquant_dispatch import svdquant_linear

    cpu = torch.device("cpu")
    assert choose_backend(cpu, "w4f8") == choose_backend(cpu, "w4f8", 0)
    assert (choose_backend(cpu, "w4f8").backend, choose_backend(cpu, "w4f8").reason) == ("reference_w4f8", "cpu device")
    assert choose_backend(cpu, "w4f8", 128).backend == "reference"  # group-wise: the W4A8 reference
    assert choose_backend(cpu, "auto").backend == "reference"
    sq, _ = _weight(48, 256, 0)
    x = torch.randn(5, 256)
    y, used = svdquant_linear(x, sq, None, backend="w4f8")
    assert used.backend == "reference_w4f8"
    assert torch.equal(y, w4f8_linear_reference(x, sq, None, lowrank_from_codes=True))


def test_w4a16_asked_for_off_cuda_runs_the_w4a16_reference(monkeypatch):
    from worldfoundry.core.acceleration.kernels import svdquant_dispatch
    from worldfoundry.core.acceleration.quantization.svdquant_numerics import w4a16_linear_reference

    monkeypatch.setattr(svdquant_dispatch, "interpreter_enabled", lambda: False)
    cpu = torch.device("cpu")
    for group in (0, 128):
        assert choose_backend(cpu, "w4a16", group) == svdquant_dispatch.BackendChoice("reference_w4a16", "cpu device")
    monkeypatch.setattr(svdquant_dispatch, "TRITON_AVAILABLE", False)
    assert choose_backend(cpu, "w4a16").backend == "reference_w4a16"
    assert choose_backend(cpu, "w4a8").backend == "reference"
    sq, _ = _weight(48, 256, 0)
    x = torch.randn(5, 256)
    y, used = svdquant_dispatch.svdquant_linear(x, sq, None, backend="w4a16")
    assert used.backend == "reference_w4a16"
    assert torch.equal(y, w4a16_linear_reference(x, sq, None))
    assert svdquant_dispatch.reference_for("reference_w4a16") is w4a16_linear_reference


@pytest.mark.parametrize("k", [100, 1536, 2304])
@pytest.mark.parametrize("gelu", [False, True])
def test_held_smoothing_quantizer_is_bitwise_the_rowwise_one(k, gelu):
    from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import _KERNEL_ARGS
    from worldfoundry.core.acceleration.kernels.fp8_smoothed_quant import triton_quantize_smoothed_fp8

    gen = torch.Generator().manual_seed(k)
    x = torch.randn(37, k, generator=gen).to(torch.bfloat16)
    inv = torch.rand(k, generator=gen) + 0.5
    quant = dict(zip(("activation", "constants"), _KERNEL_ARGS["tanh"], strict=True)) if gelu else {}
    q, s = triton_quantize_smoothed_fp8(x, inv, **quant)
    q_ref, s_ref, _ = launch_rowwise_fp8(x, inv_smooth=inv, **quant)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    if not gelu:
        ref_q, ref_s = quantize_rowwise_fp8(smoothed_rows(x, inv))
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    with pytest.raises(QuantizationInputError, match="inv_smooth must be float32"):
        triton_quantize_smoothed_fp8(x, inv[:-1])


@pytest.mark.parametrize("k", [384, 1024])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("smoothed", [True, False])
def test_one_launch_operand_is_the_two_launch_one(k, gelu, smoothed):
    """Codes and scales in one launch: bitwise those of the quantizer + appended-codes kernels (rows not a multiple
    of the tile; a producer GELU; with and without smoothing), also with another tile (``K`` 384 not a multiple of
    its ``BLOCK_K``); the appended low-rank codes at most one e4m3 step apart, and rarely that: their float32 dot
    sums follow the tile's rows (with one thread, ``k`` 384, GELU and smoothing, 1 of 1,776 differed)."""
    from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import _KERNEL_ARGS

    gen = torch.Generator().manual_seed(k)
    w = torch.randn(64, k, generator=gen) * 0.02
    amax = torch.rand(k, generator=gen) * 4 + 0.1 if smoothed else None
    sq = pad_rank(decompose(w, rank=16, group_size=0, act_absmax=amax))
    prep = sm.prepare_scaled_mm(sq)
    x = torch.randn(37, k, generator=gen).to(torch.bfloat16)
    quant = dict(zip(("activation", "constants"), _KERNEL_ARGS["tanh"], strict=True)) if gelu else {}
    a2, s2 = sm.activation_operand(x, sq, prep, held_smoothing=False, **quant)
    a1, s1 = sm.activation_operand(x, sq, prep, one_launch=True, one_launch_tile=(16, 128, 4), **quant)
    assert torch.equal(s1, s2)
    assert torch.equal(a1[:, :k].view(torch.uint8), a2[:, :k].view(torch.uint8))
    _within_one_e4m3_step(a1[:, k:], a2[:, k:])
    a3, s3 = sm.activation_operand(x, sq, prep, one_launch=True, one_launch_tile=(32, 256, 4), **quant)
    assert torch.equal(a3[:, :k].view(torch.uint8), a2[:, :k].view(torch.uint8)) and torch.equal(s3, s2)
    # another BLOCK_K sums the dot in another order: the appended codes agree within one e4m3 step of the head
    assert (a3[:, k:].float() - a2[:, k:].float()).abs().max() <= 2**-3 * a2[:, k:].float().abs().max()


def _within_one_e4m3_step(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two e4m3 code tensors equal but for codes one representable step apart (same sign and magnitude bits
    differing by one, or zero and the smallest magnitude of either sign; zero's two signs alike), on at most 1 % of
    the codes."""
    x, y = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    differ = x != y
    mag_x, mag_y = x & 0x7F, y & 0x7F
    same_sign = ((x >> 7) == (y >> 7)) | ((mag_x == 0) & (mag_y == 0))
    one_step = (same_sign & ((mag_x - mag_y).abs() <= 1)) | (mag_x + mag_y == 1)  # or across zero
    assert bool(one_step[differ].all()), "appended codes more than one step apart"
    assert int(differ.sum()) <= max(1, differ.numel() // 100)
