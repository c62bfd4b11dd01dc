"""INT8 activations with one scale per token and group of input channels (the numerics a tile-by-tile producer
can emit): each group quantized as a whole row is, the residual GEMM's sub-group sums exact, typed refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.quantization.int4_packing import unpack_int4
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8, quantize_rows_int8_grouped
from worldfoundry.core.acceleration.quantization.svdquant_numerics import (
    decompose,
    int4_gemm_reference_grouped,
    w4a8_linear_reference,
)
from worldfoundry.errors import QuantizationInputError


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), groups=st.integers(1, 6), group=st.sampled_from([1, 8, 32, 64]),
       smooth=st.booleans(), seed=st.integers(0, 2**16))
def test_each_group_is_quantized_as_a_whole_row(rows: int, groups: int, group: int, smooth: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    k = groups * group
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, k)
    inv = torch.rand(k, generator=g) + 0.5 if smooth else None
    q, scale = quantize_rows_int8_grouped(x, inv, group)
    assert q.shape == (rows, k) and scale.shape == (rows, groups) and q.dtype == torch.int8
    for i in range(groups):
        cols = slice(i * group, (i + 1) * group)
        q_i, s_i = quantize_rows_int8(x[:, cols], None if inv is None else inv[cols])
        assert torch.equal(q[:, cols], q_i) and torch.equal(scale[:, i:i + 1], s_i)


def test_one_group_per_row_is_the_per_token_quantizer_and_bad_groups_are_refused() -> None:
    x = torch.randn(5, 96)
    q, s = quantize_rows_int8_grouped(x, None, 96)
    q_ref, s_ref = quantize_rows_int8(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    for bad in (0, 7, 97, True):
        with pytest.raises(QuantizationInputError, match="must be a positive divisor of the 96 input channels"):
            quantize_rows_int8_grouped(x, None, bad)
    with pytest.raises(QuantizationInputError, match="inv_smooth has shape"):
        quantize_rows_int8_grouped(x, torch.ones(95), 32)


@pytest.mark.parametrize("w_group,act_group", [(0, 64), (0, 256), (64, 64), (64, 128), (128, 64)])
def test_grouped_gemm_is_the_exact_sum_of_scaled_group_products(w_group: int, act_group: int) -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(12, 256, generator=g), torch.randn(40, 256, generator=g)
    weight = decompose(w, rank=0, group_size=w_group)
    q, scale = quantize_rows_int8_grouped(x, None, act_group)
    got = int4_gemm_reference_grouped(q, scale, weight).double()
    codes = unpack_int4(weight.qweight, w_group).double()
    w_scales = weight.scales.double()
    sub = min(act_group, w_group or 256)
    want = torch.zeros(12, 40, dtype=torch.float64)
    for i in range(256 // sub):
        cols = slice(i * sub, (i + 1) * sub)
        part = (q.double()[:, cols] @ codes[:, cols].t()) * scale.double()[:, i * sub // act_group, None]
        want += part * (w_scales[0] if w_group == 0 else w_scales[i * sub // w_group])
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-5)


def test_groupings_that_do_not_nest_are_refused() -> None:
    weight = decompose(torch.randn(8, 192), rank=0, group_size=64)
    q, scale = quantize_rows_int8_grouped(torch.randn(2, 192), None, 48)
    with pytest.raises(QuantizationInputError, match="must nest"):
        int4_gemm_reference_grouped(q, scale, weight)


def test_grouped_scales_follow_an_outlier_channel_better() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 256, generator=g)
    x[:, 5] *= 60.0  # one outlier channel: a per-token scale spends the INT8 range on it
    w = torch.randn(32, 256, generator=g) / 16
    weight = decompose(w, rank=8, group_size=0)
    dense = x @ w.t()

    def err(y: torch.Tensor) -> float:
        return float((y - dense).norm() / dense.norm())

    per_token = w4a8_linear_reference(x, weight)
    one_group = w4a8_linear_reference(x, weight, act_group=256)
    grouped = w4a8_linear_reference(x, weight, act_group=64)
    torch.testing.assert_close(one_group, per_token, rtol=1e-5, atol=1e-5)  # another multiplication order only
    assert err(grouped) < err(per_token)


def test_dispatch_reference_with_activation_groups_is_the_grouped_reference() -> None:
    from worldfoundry.core.acceleration.kernels.svdquant_dispatch import pad_rank, svdquant_linear

    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(6, 256, generator=g), torch.randn(24, 256, generator=g)
    weight = pad_rank(decompose(w, rank=8, group_size=0, act_absmax=x.abs().amax(0)))
    y, used = svdquant_linear(x, weight, None, backend="reference", act_group=64)
    assert used.backend == "reference" and torch.equal(y, w4a8_linear_reference(x, weight, None, act_group=64))
