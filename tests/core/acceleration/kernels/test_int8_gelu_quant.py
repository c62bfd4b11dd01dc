"""The INT8 GELU producer (:mod:`...kernels.int8_gelu_quant`) under ``TRITON_INTERPRET=1``.

Given the kernel's own GELU (the FP8 producer's activation, the same Triton function, returned with
``return_activation=True``), codes and scales are **bitwise** the reference quantizer's and ``t`` is within one
bfloat16 ulp of its largest magnitude of ``bf16(g @ D.T)``; against torch's GELU (the reference of the function)
nearly every code is equal and none is more than one apart.
"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import triton_gelu_quantize_rowwise_fp8
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.core.acceleration.kernels.int8_gelu_quant import (
    GELU_NEGATIVE_BOUND,
    given_row_magnitudes,
    reference_gelu_quantize_rows_int8_lowrank,
    triton_gelu_quantize_rows_int8_lowrank,
)
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8, quantize_rows_int8_with_max
from worldfoundry.errors import QuantizationInputError

pytestmark = pytest.mark.skipif(
    not (TRITON_AVAILABLE and interpreter_enabled()), reason="needs triton with TRITON_INTERPRET=1")


def _operands(m: int, k: int, smooth: bool, rank: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed + m + k)
    h = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
    h[1] = 0.0  # GELU(0) = 0: codes 0, floor scale
    inv = (torch.rand(k, generator=g) + 0.5) if smooth else None
    down = (torch.randn(rank, k, generator=g) * 0.1).to(torch.bfloat16)
    return h, inv, down


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("m,k,smooth", [(37, 256, True), (5, 200, False), (19, 1100, True)])
def test_codes_bitwise_given_the_kernels_gelu(m, k, smooth, approximate):
    h, inv, down = _operands(m, k, smooth)
    q, s, t = triton_gelu_quantize_rows_int8_lowrank(h, approximate, inv, down)
    g = triton_gelu_quantize_rowwise_fp8(h, approximate, return_activation=True)[2]
    q_ref, s_ref = quantize_rows_int8(g, inv)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    t_ref = (g.float() @ down.float().t()).to(torch.bfloat16).float()
    assert (t.float() - t_ref).abs().max() <= 2**-7 * t_ref.abs().max()


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_close_to_the_torch_reference(approximate):
    h, inv, down = _operands(64, 512, True, seed=3)
    q, s, t = triton_gelu_quantize_rows_int8_lowrank(h, approximate, inv, down)
    q_ref, s_ref, t_ref = reference_gelu_quantize_rows_int8_lowrank(h, approximate, inv, down)
    diff = (q.int() - q_ref.int()).abs()
    assert int(diff.max()) <= 1 and float((diff == 0).float().mean()) >= 0.99
    assert torch.allclose(s, s_ref, rtol=2**-7, atol=0)
    assert (t.float() - t_ref.float()).abs().max() <= 2**-6 * t_ref.float().abs().max()


def test_bad_input_is_a_typed_error():
    down = torch.zeros(16, 128, dtype=torch.bfloat16)
    with pytest.raises(QuantizationInputError, match="h must be bfloat16"):
        triton_gelu_quantize_rows_int8_lowrank(torch.randn(4, 128), "tanh", None, down)
    with pytest.raises(QuantizationInputError, match="approximate='sigmoid'"):
        triton_gelu_quantize_rows_int8_lowrank(torch.randn(4, 128).to(torch.bfloat16), "sigmoid", None, down)
    with pytest.raises(QuantizationInputError, match="down factor bfloat16"):
        triton_gelu_quantize_rows_int8_lowrank(torch.randn(4, 64).to(torch.bfloat16), "tanh", None, down)


def test_no_rows():
    q, s, t = triton_gelu_quantize_rows_int8_lowrank(torch.zeros(0, 128, dtype=torch.bfloat16), "tanh", None,
                                                     torch.zeros(16, 128, dtype=torch.bfloat16))
    assert q.shape == (0, 128) and s.shape == (0, 1) and t.shape == (0, 16)


def _row_max(h: torch.Tensor) -> torch.Tensor:
    """What the up projection's GEMM merges: each row's largest value, floored at 0."""
    return h.float().amax(dim=1).clamp_min(0.0).contiguous()


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("m,k", [(37, 256), (5, 200), (19, 1100)])
def test_given_row_maxima_codes_bitwise_given_the_kernels_gelu(m, k, approximate):
    """One pass with the row maxima given: codes and scales bitwise the reference quantizer's against the given
    magnitudes (of the kernel's own GELU); ``t`` as in the two-pass form."""
    h, _, down = _operands(m, k, False)
    h[2] = -(h[2].abs())  # a row with no positive value: the negative bound sets its scale
    rm = _row_max(h)
    q, s, t = triton_gelu_quantize_rows_int8_lowrank(h, approximate, None, down, row_max=rm)
    g = triton_gelu_quantize_rowwise_fp8(h, approximate, return_activation=True)[2]
    top = triton_gelu_quantize_rowwise_fp8(rm.to(torch.bfloat16)[:, None], approximate, return_activation=True)[2]
    amax = top.float().clamp_min(GELU_NEGATIVE_BOUND)
    q_ref, s_ref = quantize_rows_int8_with_max(g.float(), amax)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert float(s[2]) == pytest.approx(GELU_NEGATIVE_BOUND / 127, rel=1e-7)
    t_ref = (g.float() @ down.float().t()).to(torch.bfloat16).float()
    assert (t.float() - t_ref).abs().max() <= 2**-7 * t_ref.abs().max()


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_given_row_maxima_match_the_measured_ones_where_a_row_reaches_the_bound(approximate):
    """Rows whose largest value is above about 0.28 get the same magnitude the two-pass form measures, so the same
    codes; the bound covers every negative value, so no code of a low row clamps."""
    h, _, down = _operands(48, 384, False, seed=5)
    h[1] = 0.0
    rm = _row_max(h)
    q1, s1, t1 = triton_gelu_quantize_rows_int8_lowrank(h, approximate, None, down, row_max=rm)
    q2, s2, t2 = triton_gelu_quantize_rows_int8_lowrank(h, approximate, None, down)
    high = rm > 0.3
    assert int(high.sum()) >= 40
    assert torch.equal(q1[high], q2[high]) and torch.equal(s1[high], s2[high]) and torch.equal(t1, t2)
    assert float(s1[1]) == pytest.approx(GELU_NEGATIVE_BOUND / 127, rel=1e-7) and int(q1[1].abs().max()) == 0


def test_negative_bound_covers_every_negative_bfloat16():
    """``|bf16(GELU(x))| < GELU_NEGATIVE_BOUND`` for every negative bfloat16 ``x`` (both forms, exact formula),
    with the margin the kernel's approximation needs (``2**-8`` relative)."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    neg = x[torch.isfinite(x) & (x < 0)].double()
    for approximate in ("tanh", "none"):
        worst = torch.nn.functional.gelu(neg, approximate=approximate).abs().max()
        assert float(worst) * (1 + 2**-8) < GELU_NEGATIVE_BOUND


def test_given_row_maxima_reference_and_refusals():
    h, inv, down = _operands(16, 128, True, seed=2)
    rm = _row_max(h)
    q_ref, s_ref, _ = reference_gelu_quantize_rows_int8_lowrank(h, "tanh", None, down, row_max=rm)
    magnitudes = given_row_magnitudes(rm, "tanh")
    assert torch.equal(s_ref, torch.div(magnitudes, torch.full_like(magnitudes, 127.0)))
    q, s, _ = triton_gelu_quantize_rows_int8_lowrank(h, "tanh", None, down, row_max=rm)
    assert int((q.int() - q_ref.int()).abs().max()) <= 1
    with pytest.raises(QuantizationInputError, match="row_max needs an unsmoothed down projection"):
        triton_gelu_quantize_rows_int8_lowrank(h, "tanh", inv, down, row_max=rm)
    with pytest.raises(QuantizationInputError, match=r"row_max must be a contiguous float32 \[16\]"):
        triton_gelu_quantize_rows_int8_lowrank(h, "tanh", None, down, row_max=rm[:8])
    with pytest.raises(QuantizationInputError, match="row_max must be"):
        reference_gelu_quantize_rows_int8_lowrank(h, "tanh", None, down, row_max=rm.double())
    with pytest.raises(QuantizationInputError, match="packed_rounding is inline PTX"):
        triton_gelu_quantize_rows_int8_lowrank(h, "tanh", None, down, row_max=rm, packed_rounding=True)
