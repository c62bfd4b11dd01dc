"""Per-output-channel INT4 residual (``group_size = 0``): packing, quantization error, reference GEMM.

Claims: packing round-trips every code (pairs along K; property test); the per-channel quantization error is
at most half of the row's scale step (property test); 
the reference residual GEMM's integer is exact (equal to an int64 matmul) before its float32 rounding; bad K and
group values are one-line typed errors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.quantization.int4_packing import (
    CHANNEL_K_MULTIPLE,
    PER_CHANNEL,
    dequantize_int4_groupwise,
    describe_grouping,
    pack_int4,
    quantize_int4_groupwise,
    scale_groups,
    unpack_int4,
)
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8
from worldfoundry.core.acceleration.quantization.svdquant_numerics import decompose, int4_gemm_reference
from worldfoundry.errors import QuantizationInputError


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_per_channel_pack_unpack_round_trips_every_code(n, blocks, seed):
    k = CHANNEL_K_MULTIPLE * blocks
    codes = torch.randint(-8, 8, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    packed = pack_int4(codes, PER_CHANNEL)
    assert torch.equal(packed[:, 0] & 0x0F, codes[:, 0] & 0x0F) and torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(unpack_int4(packed, PER_CHANNEL), codes)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_per_channel_error_is_at_most_half_the_row_step(n, blocks, magnitude, seed):
    w = torch.randn(n, CHANNEL_K_MULTIPLE * blocks, generator=torch.Generator().manual_seed(seed)) * magnitude
    packed, scales = quantize_int4_groupwise(w, PER_CHANNEL)
    assert scales.shape == (1, n) and scales.dtype == torch.bfloat16
    err = (dequantize_int4_groupwise(packed, scales, PER_CHANNEL) - w).abs()
    # the bf16 scale may round below amax / 7: the row max then clamps at code 7 (|w| <= 7.03 s), still <= s / 2
    assert bool((err <= scales.float().t() / 2 * (1 + 1e-6)).all())


def test_grouping_helpers_and_errors():
    assert scale_groups(256, PER_CHANNEL) == 1 and scale_groups(256, 64) == 4
    assert describe_grouping(PER_CHANNEL) == "per channel" and describe_grouping(128) == "group 128"
    with pytest.raises(QuantizationInputError, match="not a multiple of the per-channel K step 128"):
        quantize_int4_groupwise(torch.randn(4, 192), PER_CHANNEL)
    with pytest.raises(QuantizationInputError, match="group_size must be 0"):
        quantize_int4_groupwise(torch.randn(4, 128), True)


def test_reference_integer_is_exact_before_float_rounding():
    g = torch.Generator().manual_seed(1)
    w = decompose(torch.randn(24, 1024, generator=g), rank=0, group_size=PER_CHANNEL)
    x = torch.randn(9, 1024, generator=g) * 4
    q, s = quantize_rows_int8(x)
    exact = q.long() @ unpack_int4(w.qweight, PER_CHANNEL).long().t()
    expect = exact.float() * w.scales.float()[0] * s
    assert torch.equal(int4_gemm_reference(q, s, w), expect)


def test_per_channel_output_error_is_bounded_like_group_128_on_gaussian_weights():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 512, generator=g) * 0.02
    x = torch.randn(32, 512, generator=g)
    dense = x @ w.t()
    errs = {}
    for group in (PER_CHANNEL, 128):
        q, s = quantize_rows_int8(x)
        out = int4_gemm_reference(q, s, decompose(w, rank=0, group_size=group))
        errs[group] = float((out - dense).norm() / dense.norm())
    assert errs[128] < errs[PER_CHANNEL] < 0.2  # coarser scales cost accuracy, within INT4's usual range
