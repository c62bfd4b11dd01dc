"""The one-read INT8 quantizer with scales per token and group, and the low-rank down projection
(:mod:`...kernels.int8_grouped_quant_lowrank`) under ``TRITON_INTERPRET=1``: codes and scales **bitwise**
``quantize_rows_int8_grouped``'s; ``t`` within one bfloat16 ulp of its largest magnitude (``2**-7 * max|t_ref|``:
float32 sums in another order, then bfloat16 rounding) of ``bf16(bf16(x) @ D.T)``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.core.acceleration.kernels.int8_grouped_quant_lowrank import (
    triton_quantize_rows_int8_grouped_lowrank,
)
from worldfoundry.core.acceleration.quantization.int8_activation import (
    quantize_rows_int8,
    quantize_rows_int8_grouped,
)
from worldfoundry.errors import QuantizationInputError

pytestmark = pytest.mark.skipif(
    not (TRITON_AVAILABLE and interpreter_enabled()), reason="needs triton with TRITON_INTERPRET=1")


def _operands(m: int, k: int, smooth: bool, rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    if m > 1:
        x[1] = 0.0  # an all-zero row: codes 0, floor scales
    inv = (torch.rand(k, generator=g) + 0.5) if smooth else None
    down = (torch.randn(rank, k, generator=g) * 0.1).to(torch.bfloat16) if rank else None
    return x, inv, down


@pytest.mark.parametrize("m,k,group,smooth", [(37, 256, 128, True), (5, 192, 64, False), (16, 512, 256, True),
                                              (19, 384, 128, True), (3, 96, 32, True)])
def test_codes_bitwise_and_lowrank_within_one_ulp(m, k, group, smooth):
    x, inv, down = _operands(m, k, smooth, 16, m + k)
    q, s, t = triton_quantize_rows_int8_grouped_lowrank(x, inv, down, group)
    q_ref, s_ref = quantize_rows_int8_grouped(x, inv, group)
    assert s.shape == (m, k // group) and torch.equal(q, q_ref) and torch.equal(s, s_ref)
    t_ref = (x.float() @ down.float().t()).to(torch.bfloat16).float()
    assert (t.float() - t_ref).abs().max() <= 2**-7 * t_ref.abs().max()


def test_without_a_down_factor_only_codes_and_scales():
    x, inv, _ = _operands(9, 256, True, 0, 3)
    q, s, t = triton_quantize_rows_int8_grouped_lowrank(x, inv, None, 64)
    q_ref, s_ref = quantize_rows_int8_grouped(x, inv, 64)
    assert t is None and torch.equal(q, q_ref) and torch.equal(s, s_ref)


def test_one_group_per_row_is_the_per_token_quantizer():
    x, inv, down = _operands(7, 128, True, 16, 5)
    q, s, _ = triton_quantize_rows_int8_grouped_lowrank(x, inv, down, 128)
    q_ref, s_ref = quantize_rows_int8(x, inv)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 40), groups=st.integers(1, 4), group=st.sampled_from([32, 64]),
       scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_any_rows_any_scale_bitwise(m, groups, group, scale, seed):
    """Magnitudes from 1e-3 to 1e3 and any row count (ragged last block): codes and scales stay bitwise."""
    g = torch.Generator().manual_seed(seed)
    k = groups * group
    x = (torch.randn(m, k, generator=g) * scale).to(torch.bfloat16)
    inv = torch.rand(k, generator=g) + 0.25
    q, s, _ = triton_quantize_rows_int8_grouped_lowrank(x, inv, None, group)
    q_ref, s_ref = quantize_rows_int8_grouped(x, inv, group)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"group": 48}, "group 48 must be one of"),
    ({"group": 256, "k": 384}, "divide the 384 input channels"),
    ({"rank": 8}, "rank 8 must be a power of two"),
    ({"inv": torch.ones(7)}, "inv_smooth must be float32"),
    ({"block_m": 8}, "block_m 8 must be a power of two >= 16"),
])
def test_bad_operands_are_typed_errors(kwargs, message):
    k = kwargs.get("k", 256)
    x = torch.randn(4, k)
    down = torch.zeros(kwargs.get("rank", 16), k, dtype=torch.bfloat16)
    with pytest.raises(QuantizationInputError, match=message):
        triton_quantize_rows_int8_grouped_lowrank(x, kwargs.get("inv"), down, kwargs.get("group", 128),
                                                  block_m=kwargs.get("block_m"))


@pytest.mark.parametrize("m", [1, 6, 37])
def test_transposed_scales_are_the_same_values_group_major(m):
    """``transposed_scales``: the same codes and scale values, written group-major into a buffer whose row pitch
    is ``M`` rounded up to 4 tokens (what the Gluon grouped GEMM reads in place)."""
    x, inv, down = _operands(m, 384, True, 16, 11)
    q, s, t = triton_quantize_rows_int8_grouped_lowrank(x, inv, down, 128, transposed_scales=True)
    q_ref, s_ref = quantize_rows_int8_grouped(x, inv, 128)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert s.shape == (m, 3) and s.stride() == (1, -(-m // 4) * 4)
