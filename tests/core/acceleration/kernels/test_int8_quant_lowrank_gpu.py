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


@pytest.mark.parametrize("k", [1536, 8960])
def test_default_launch_shapes_repeat_bitwise_at_w81(k):
    """The default launch shapes of both fused input kernels give the same output on every run at the W81 FFN
    shape (with triton 3.6 a 64 x 128 shape of the quantizer + low-rank kernel did not: ``t`` changed between runs,
    ``benchmarks/kernels/int8_lowrank_check.py``)."""
    from worldfoundry.core.acceleration.kernels.int8_gelu_quant import triton_gelu_quantize_rows_int8_lowrank

    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(32760, k, generator=g, device="cuda").to(torch.bfloat16)
    inv = torch.rand(k, generator=g, device="cuda") + 0.5
    down = (torch.randn(32, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    for run in (lambda: triton_quantize_rows_int8_lowrank(x, inv, down, single_pass=False),
                lambda: triton_gelu_quantize_rows_int8_lowrank(x, "tanh", inv, down)):
        first = run()
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(run(), first))
