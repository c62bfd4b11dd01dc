"""The fused INT8 quantizer + low-rank down projection (:mod:`...kernels.int8_quant_lowrank`) under
``TRITON_INTERPRET=1``: codes and scales **bitwise** the reference quantizer's; ``t`` within one bfloat16 ulp of
its largest magnitude (``2**-7 * max|t_ref|``: float32 sums in another order, then bfloat16 rounding) of
``bf16(bf16(x) @ D.T)``; the W4A8 Linear through the fused path within one bfloat16 ulp of max of the reference."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import triton_quantize_rows_int8_lowrank
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import pad_rank, svdquant_linear
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8
from worldfoundry.core.acceleration.quantization.svdquant_numerics import decompose, w4a8_linear_reference
from worldfoundry.errors import QuantizationInputError

pytestmark = pytest.mark.skipif(
    not (TRITON_AVAILABLE and interpreter_enabled()), reason="needs triton with TRITON_INTERPRET=1")


@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("m,k,smooth", [(37, 256, True), (5, 200, False), (16, 1536, True), (19, 1100, True)])
def test_codes_bitwise_and_lowrank_within_one_ulp(m, k, smooth, single):
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    x[1] = 0.0  # an all-zero row: codes 0, floor scale
    inv = (torch.rand(k, generator=g) + 0.5) if smooth else None
    down = (torch.randn(16, k, generator=g) * 0.1).to(torch.bfloat16)
    q, s, t = triton_quantize_rows_int8_lowrank(x, inv, down, single_pass=single)
    q_ref, s_ref = quantize_rows_int8(x, inv)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    t_ref = (x.float() @ down.float().t()).to(torch.bfloat16).float()
    assert (t.float() - t_ref).abs().max() <= 2**-7 * t_ref.abs().max()


@pytest.mark.parametrize("programs", [1, 2, 3])
def test_fewer_programs_walking_row_blocks_give_the_same_bytes(programs):
    """``programs`` below the block count: each program walks blocks ``pid, pid + P, ...`` (ragged last block
    included); every output is bitwise the one-program-per-block launch's."""
    g = torch.Generator().manual_seed(programs)
    x = (torch.randn(83, 192, generator=g) * 2).to(torch.bfloat16)
    inv = torch.rand(192, generator=g) + 0.5
    down = (torch.randn(16, 192, generator=g) * 0.1).to(torch.bfloat16)
    plain = triton_quantize_rows_int8_lowrank(x, inv, down, single_pass=False)
    walked = triton_quantize_rows_int8_lowrank(x, inv, down, single_pass=False, programs=programs)
    assert all(torch.equal(a, b) for a, b in zip(plain, walked))
    staged = triton_quantize_rows_int8_lowrank(x, inv, down, single_pass=False, num_stages=2)
    assert all(torch.equal(a, b) for a, b in zip(plain, staged))


@pytest.mark.parametrize("group", [0, 64])
def test_w4a8_linear_through_the_fused_path(group):
    g = torch.Generator().manual_seed(9)
    w = torch.randn(48, 256, generator=g) * 0.05
    weight = pad_rank(decompose(w, rank=8, group_size=group, act_absmax=torch.rand(256, generator=g) * 4 + 0.1))
    x = torch.randn(3, 11, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    y, used = svdquant_linear(x, weight, b, backend="w4a8", fused_lowrank=True)
    ref = w4a8_linear_reference(x, weight, b).float()
    assert used.backend == "w4a8" and (y.float() - ref).abs().max() <= 2**-7 * ref.abs().max()


def test_single_pass_limits_are_typed_errors():
    down = torch.zeros(16, 128, dtype=torch.bfloat16)
    with pytest.raises(QuantizationInputError, match="power-of-two block_m >= 16"):
        triton_quantize_rows_int8_lowrank(torch.randn(4, 128), None, down, single_pass=True, block_m=8)
    wide = torch.randn(2, 2112)
    with pytest.raises(QuantizationInputError, match="rows up to 2048"):
        triton_quantize_rows_int8_lowrank(wide, None, torch.zeros(16, 2112, dtype=torch.bfloat16), single_pass=True)
    with pytest.raises(QuantizationInputError, match="needs 327680 bytes of shared memory"):  # 2048 * (16 + 64) * 2
        triton_quantize_rows_int8_lowrank(torch.randn(2, 2048), None, torch.zeros(64, 2048, dtype=torch.bfloat16),
                                          single_pass=True)


def test_bad_operands_are_typed_errors():
    x = torch.randn(4, 128)
    with pytest.raises(QuantizationInputError, match="rank 8 must be a power of two"):
        triton_quantize_rows_int8_lowrank(x, None, torch.zeros(8, 128, dtype=torch.bfloat16))
    with pytest.raises(QuantizationInputError, match="down factor bfloat16"):
        triton_quantize_rows_int8_lowrank(x, None, torch.zeros(16, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("group", [64, 0])
def test_w4a8_linear_merges_each_output_rows_maximum(group):
    """``row_max`` receives max(what it held, the row's largest output, 0): from the Triton GEMM's output here."""
    g = torch.Generator().manual_seed(9)
    w, b = torch.randn(96, 128, generator=g) * 0.2, torch.randn(96, generator=g).to(torch.bfloat16)
    weight = pad_rank(decompose(w, rank=8, group_size=group, act_absmax=torch.rand(128, generator=g) + 0.5))
    x = torch.randn(2, 9, 128, generator=g).to(torch.bfloat16)
    row_max = torch.zeros(18)
    row_max[3] = 1e6  # a larger value already there stays
    y, _ = svdquant_linear(x, weight, b, backend="w4a8", row_max=row_max)
    expected = y.reshape(18, 96).amax(dim=1).float().clamp_min(0.0)
    expected[3] = 1e6
    assert torch.equal(row_max, expected)
    with pytest.raises(QuantizationInputError, match="row_max is written by the W4A8 GEMM"):
        svdquant_linear(x, weight, b, backend="reference", row_max=torch.zeros(18))
    with pytest.raises(QuantizationInputError, match=r"row_max must be a contiguous float32 \[18\]"):
        svdquant_linear(x, weight, b, backend="w4a8", row_max=torch.zeros(17))
