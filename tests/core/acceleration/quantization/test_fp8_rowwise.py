"""Rowwise FP8 e4m3fn quantization (torch reference) against float64 math, and the rowwise FP8 Linear.

Stated bounds (derived in ``worldfoundry/core/acceleration/quantization/fp8.py``):

* element: ``|x - q*s| <= max(|x|*(2**-4 + 2**-22), s*2**-10 + |x|*2**-22)``;
* Linear (FP8 operands, float32 product): ``|y - x@W.T| <= |x|@Bw.T + Bx@|W|.T + Bx@Bw.T + K*2**-23*(|x~|@|W~|.T)``
  with ``Bx``, ``Bw`` the element bounds of the two operands;
* for Gaussian data the relative L2 error of one FP8 Linear is below 0.05 (about 0.036 measured).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration import quantization
from worldfoundry.core.acceleration.quantization.fp8 import (
    AMAX_FLOOR,
    CLIP_THRESHOLD,
    FP8_E4M3_MAX,
    count_clipped,
    dequantize_rowwise_fp8,
    quantize_rowwise_fp8,
    rowwise_error_bound,
    rowwise_scales,
)
from worldfoundry.core.acceleration.quantization.fp8_linear import (
    FP8RowwiseWeight,
    fp8_linear_fallback_reason,
    fp8_rowwise_linear,
    fp8_rowwise_linear_reference,
    misaligned_dims,
    quantize_weight_rowwise_fp8,
)
from worldfoundry.errors import QuantizationInputError

# every finite e4m3fn value (bytes 0x00..0x7e and their negatives)
E4M3_GRID = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)


def _rows(seed: int, m: int, k: int, spread: float, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-spread, spread, m, dtype=torch.float64)[:, None]
    return (torch.randn(m, k, generator=g, dtype=torch.float64) * magnitudes).to(dtype)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 9), k=st.integers(1, 70),
       spread=st.floats(0.0, 6.0), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_quantization_error_within_the_stated_bound(seed, m, k, spread, dtype):
    x = _rows(seed, m, k, spread, dtype)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    q, scale = quantize_rowwise_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (m, 1)
    x64 = x.to(torch.float64)
    error = (x64 - dequantize_rowwise_fp8(q, scale, torch.float64)).abs()
    assert torch.all(error <= rowwise_error_bound(x, scale)), float((error - rowwise_error_bound(x, scale)).max())
    # scale = max(amax, floor) / 448, correctly rounded to float32
    amax64 = x64.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR)
    assert torch.all(((scale.double() - amax64 / FP8_E4M3_MAX).abs() / (amax64 / FP8_E4M3_MAX)) <= 2.0**-24 * 1.01)
    # the row maximum maps onto the top of the FP8 range
    top = q.to(torch.float32).abs().amax(dim=-1)
    assert torch.all(top == torch.where(amax64[:, 0] > AMAX_FLOOR, 448.0, 0.0).float())


def test_values_on_the_e4m3_grid_are_exact_and_ties_round_to_even():
    # with amax = 448 the scale is exactly 1, so x / scale == x
    grid = torch.cat([E4M3_GRID, -E4M3_GRID]).to(torch.float32)
    q, scale = quantize_rowwise_fp8(grid[None, :])
    assert scale.item() == 1.0
    assert torch.equal(q.to(torch.float32)[0], grid)
    ties = torch.tensor([[448.0, 1.3125, 42.0, 126.0, 3 * 2.0**-10, 2.0**-10, -1.3125, 0.0]])
    q, _ = quantize_rowwise_fp8(ties)
    # 1.3125 lies between 1.25 and 1.375 -> even mantissa 1.25; 42 -> 40; 126 -> 128; 3*2**-10 -> 2*2**-9 (even)
    assert q.to(torch.float32)[0].tolist() == [448.0, 1.25, 40.0, 128.0, 2.0**-8, 0.0, -1.25, 0.0]


def test_zero_rows_get_a_finite_positive_scale_and_zero_codes():
    x = torch.zeros(3, 32)
    x[1, 5] = -2.5
    q, scale = quantize_rowwise_fp8(x)
    assert torch.all(scale > 0) and torch.all(torch.isfinite(scale))
    assert scale[0].item() == pytest.approx(AMAX_FLOOR / 448, rel=1e-6)
    assert torch.count_nonzero(q.to(torch.float32)[0]) == 0
    assert q.to(torch.float32)[1, 5].item() == -448.0


def test_rowwise_scales_and_clip_count():
    expected = torch.tensor([1.0, AMAX_FLOOR]) / torch.tensor([1.0, 448.0])
    assert torch.equal(rowwise_scales(torch.tensor([448.0, 0.0])), expected)
    x = torch.randn(4, 64)
    _, scale = quantize_rowwise_fp8(x)
    assert count_clipped(x, scale).item() == 0
    x[2, 3] = float("inf")
    x[0, 0] = float("nan")
    _, scale = quantize_rowwise_fp8(x)
    # inf row: scale inf, only inf / inf = nan clips; nan row: the scale is nan, so all 64 elements clip
    assert count_clipped(x, scale).item() == 1 + 64
    # a stale (too small) scale clips everything at or above the threshold
    small = torch.full((1, 8), CLIP_THRESHOLD)
    small[0, :4] = 1.0
    assert count_clipped(small, torch.ones(1, 1)).item() == 4


def test_input_validation():
    with pytest.raises(QuantizationInputError, match="float"):
        quantize_rowwise_fp8(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(QuantizationInputError, match="non-empty last dimension"):
        quantize_rowwise_fp8(torch.ones(2, 0))
    with pytest.raises(QuantizationInputError, match="float8_e4m3fn"):
        dequantize_rowwise_fp8(torch.ones(2, 2), torch.ones(2, 1))
    with pytest.raises(QuantizationInputError, match="2-D"):
        quantize_weight_rowwise_fp8(torch.ones(2, 2, 2))
    w = quantize_weight_rowwise_fp8(torch.randn(16, 32))
    with pytest.raises(QuantizationInputError, match="expects 32"):
        fp8_rowwise_linear(torch.randn(3, 16), w)


def test_weight_layout_matches_scaled_mm():
    w = torch.randn(48, 32)
    packed = quantize_weight_rowwise_fp8(w)
    assert isinstance(packed, FP8RowwiseWeight)
    assert packed.qweight.shape == (48, 32) and packed.qweight.is_contiguous()
    assert packed.scale.shape == (1, 48) and packed.scale.dtype == torch.float32 and packed.scale.is_contiguous()
    assert packed.qweight.t().stride() == (1, 32)  # column-major mat2
    assert packed.nbytes == 48 * 32 + 48 * 4
    assert (packed.in_features, packed.out_features) == (32, 48)
    q, s = quantize_rowwise_fp8(w)
    assert torch.equal(packed.qweight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(packed.dequantize(), dequantize_rowwise_fp8(q, s))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 20), k=st.sampled_from([16, 48, 96]),
       n=st.sampled_from([16, 32]), bias=st.booleans())
def test_reference_linear_within_the_stated_bound(seed, m, k, n, bias):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, m, dtype=torch.float64)[:, None]
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / math.sqrt(k)
    b = torch.randn(n, generator=g, dtype=torch.float64) if bias else None
    x32, w32 = x.float(), w.float()
    packed = quantize_weight_rowwise_fp8(w32)
    y = fp8_rowwise_linear_reference(x32, packed, b.float() if b is not None else None).double()
    exact = x32.double() @ w32.double().t() + (b.float().double() if b is not None else 0.0)
    qx, sx = quantize_rowwise_fp8(x32)
    bx = rowwise_error_bound(x32, sx)
    bw = rowwise_error_bound(w32, packed.scale.reshape(-1, 1))
    xa, wa = x32.double().abs(), w32.double().abs()
    xt = dequantize_rowwise_fp8(qx, sx, torch.float64).abs()
    wt = packed.dequantize(torch.float32).double().abs()
    bias_abs = b.abs().float().double() if b is not None else 0.0
    bound = xa @ bw.t() + bx @ wa.t() + bx @ bw.t() + (k + 2) * 2.0**-23 * (xt @ wt.t() + bias_abs)
    assert torch.all((y - exact).abs() <= bound)


def test_fp8_linear_relative_l2_on_gaussian_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=g)
    w = torch.randn(128, 256, generator=g) / 16
    y = fp8_rowwise_linear_reference(x, quantize_weight_rowwise_fp8(w))
    exact = x.double() @ w.double().t()
    rel = ((y.double() - exact).norm() / exact.norm()).item()
    assert 0.005 < rel < 0.05


def test_fp8_linear_on_cpu_scaled_mm_matches_reference():
    # CPU torch implements torch._scaled_mm; the plugin never runs FP8 on the CPU, but the function works there.
    g = torch.Generator().manual_seed(3)
    packed = quantize_weight_rowwise_fp8(torch.randn(48, 64, generator=g))
    x = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    for bias in (None, torch.randn(48, generator=g).to(torch.bfloat16), torch.randn(48, generator=g)):
        try:
            y = fp8_rowwise_linear(x, packed, bias)
        except RuntimeError as exc:  # pragma: no cover - torch builds without CPU _scaled_mm
            pytest.skip(f"torch._scaled_mm unavailable on this CPU build: {exc}")
        ref = fp8_rowwise_linear_reference(x, packed, bias)
        pre_bias = fp8_rowwise_linear_reference(x, packed)
        assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 48)
        # bfloat16 output: one bf16 rounding (bias fused), or two when a float32 bias is added afterwards
        assert torch.all((y.float() - ref).abs() <= (pre_bias.abs() + ref.abs()) * 2.0**-8 + 1e-4)


def test_fallback_reasons_and_alignment_helpers():
    assert fp8_linear_fallback_reason(torch.device("cpu")) == "cpu device"
    assert fp8_linear_fallback_reason(torch.device("meta")) == "meta device"
    assert misaligned_dims(1536, 8960) == []
    assert misaligned_dims(100, 40) == ["in_features=100", "out_features=40"]


def test_package_exports_resolve_lazily():
    assert quantization.quantize_rowwise_fp8 is quantize_rowwise_fp8
    assert quantization.fp8_rowwise_linear is fp8_rowwise_linear
    assert quantization.FP8RowwiseWeight is FP8RowwiseWeight
    with pytest.raises(AttributeError):
        quantization.no_such_name  # noqa: B018
