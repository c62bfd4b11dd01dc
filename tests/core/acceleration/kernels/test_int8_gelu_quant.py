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
    reference_gelu_quantize_rows_int8_lowrank,
    triton_gelu_quantize_rows_int8_lowrank,
)
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8
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
