"""The one-read grouped INT8 quantizer + low-rank down projection on CUDA: codes and scales bitwise
``quantize_rows_int8_grouped``'s, ``t`` within one bfloat16 ulp of its largest magnitude, every run the same, at
ragged and W81 shapes; and the W4A8 Linear with activation groups through it against the reference.

Skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE
from worldfoundry.core.acceleration.kernels.int8_grouped_quant_lowrank import (
    triton_quantize_rows_int8_grouped_lowrank,
)
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import W4A8_GLUON, pad_rank, svdquant_linear
from worldfoundry.core.acceleration.kernels.w4a8_gluon_kernels import GLUON_AVAILABLE
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8_grouped
from worldfoundry.core.acceleration.quantization.svdquant_numerics import decompose, w4a8_linear_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE), reason="needs CUDA and triton"),
]


@pytest.mark.parametrize("block_m", [None, 16, 128])
@pytest.mark.parametrize("m,k,group,rank", [(37, 256, 64, 16), (4100, 1536, 128, 32), (4100, 8960, 128, 32),
                                            (1000, 8960, 256, 64)])
def test_codes_bitwise_lowrank_within_one_ulp_and_repeatable(m, k, group, rank, block_m):
    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.bfloat16)
    x[1] = 0.0
    inv = torch.rand(k, device="cuda", generator=g) + 0.5
    down = (torch.randn(rank, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    q, s, t = triton_quantize_rows_int8_grouped_lowrank(x, inv, down, group, block_m=block_m)
    q_ref, s_ref = quantize_rows_int8_grouped(x, inv, group)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    t_ref = (x.float() @ down.float().t()).to(torch.bfloat16).float()
    assert (t.float() - t_ref).abs().max() <= 2**-7 * t_ref.abs().max()
    again = triton_quantize_rows_int8_grouped_lowrank(x, inv, down, group, block_m=block_m)
    assert all(torch.equal(a, b) for a, b in zip((q, s, t), again))


def test_w4a8_linear_with_activation_groups_on_cuda():
    """``backend: w4a8`` with ``activation_group`` 128 on a per-channel weight: the one-read quantizer writes the
    scales group-major and the Gluon grouped GEMM reads them in place on a Hopper GPU (the Triton GEMM's per-K-step
    scales elsewhere); the result is the grouped reference's within one bfloat16 ulp of its max."""
    g = torch.Generator(device="cuda").manual_seed(4)
    w = (torch.randn(256, 1024, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    x = torch.randn(3, 70, 1024, generator=g, device="cuda").to(torch.bfloat16)
    weight = pad_rank(decompose(w, rank=32, group_size=0, act_absmax=x.float().abs().amax((0, 1))))
    y, used = svdquant_linear(x, weight, None, backend="w4a8", act_group=128)
    ref = w4a8_linear_reference(x, weight, None, act_group=128).float()
    hopper = torch.cuda.get_device_capability()[0] == 9 and GLUON_AVAILABLE
    assert used.backend == (W4A8_GLUON if hopper else "w4a8")
    assert (y.float() - ref).abs().max() <= 2**-7 * ref.abs().max()
