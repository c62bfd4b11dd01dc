"""The fused INT8 quantizer + low-rank down projection on CUDA: codes and scales bitwise the reference's, ``t``
within one bfloat16 ulp of its largest magnitude, in both forms (two passes, single pass), at ragged and W81 shapes.

Skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE
from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import (
    SINGLE_PASS_MAX_K,
    triton_quantize_rows_int8_lowrank,
)
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE), reason="needs CUDA and triton"),
]


@pytest.mark.parametrize("single", [None, True, False])
@pytest.mark.parametrize("m,k,rank", [(37, 256, 16), (4100, 1536, 32), (1000, 1100, 64), (4100, 8960, 32),
                                      (3, SINGLE_PASS_MAX_K, 32)])
def test_codes_bitwise_and_lowrank_within_one_ulp(m, k, rank, single):
    if single and k > SINGLE_PASS_MAX_K:
        pytest.skip("the single pass takes rows up to SINGLE_PASS_MAX_K")
    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.bfloat16)
    x[1] = 0.0
    inv = torch.rand(k, device="cuda", generator=g) + 0.5
    down = (torch.randn(rank, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    q, s, t = triton_quantize_rows_int8_lowrank(x, inv, down, single_pass=single)
    q_ref, s_ref = quantize_rows_int8(x, inv)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    t_ref = (x.float() @ down.float().t()).to(torch.bfloat16).float()
    assert (t.float() - t_ref).abs().max() <= 2**-7 * t_ref.abs().max()
