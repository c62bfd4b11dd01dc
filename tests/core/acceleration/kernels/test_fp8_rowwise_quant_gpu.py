"""The fused Triton rowwise FP8 kernel on CUDA: bitwise equal to the torch reference on many shapes.

Skipped without a CUDA device. Shapes include odd row counts, the W81 FFN shapes (32,760 rows of 1,536 and of
8,960 features), rows longer than one pass, and strided rows.
"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.kernels.dispatch import quantize_activations_rowwise_fp8
from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import (
    SINGLE_PASS_MAX_K,
    TRITON_AVAILABLE,
    triton_quantize_rowwise_fp8,
)
from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE), reason="needs CUDA and triton"),
]

SHAPES = [
    (1, 16), (3, 1536), (17, 8960), (127, 40), (1023, 1536), (4097, 3072), (32760, 1536), (32760, 8960),
    (5, SINGLE_PASS_MAX_K + 48), (2, 5120 * 4), (9, 3, 1536),
]


def _assert_bitwise(x: torch.Tensor, software_rounding: bool | None = None) -> None:
    q, scale = triton_quantize_rowwise_fp8(x, software_rounding=software_rounding)
    q_ref, scale_ref = quantize_rowwise_fp8(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_bitwise_equal_on_cuda(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g, device="cuda") * torch.logspace(-4, 4, shape[0], device="cuda").reshape(
        -1, *([1] * (len(shape) - 1)))
    _assert_bitwise(x.to(dtype))


def test_strided_rows_on_cuda():
    wide = torch.randn(4099, 2048, device="cuda", dtype=torch.bfloat16)
    _assert_bitwise(wide[:, 256:1792])
    _assert_bitwise(wide[::3, :1536])
    _assert_bitwise(torch.randn(1536, 333, device="cuda", dtype=torch.bfloat16).t())


@pytest.mark.parametrize("software_rounding", [False, True])
def test_every_bfloat16_value_on_cuda(software_rounding):
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = bits[bits.float().abs() <= 448.0]
    values = torch.cat([values, -values])
    pad = (-values.numel()) % 1023
    values = torch.cat([values, torch.zeros(pad, dtype=torch.bfloat16)]).reshape(-1, 1023)
    rows = torch.cat([values, torch.full((values.shape[0], 1), 448.0, dtype=torch.bfloat16)], dim=1)
    _assert_bitwise(rows.cuda(), software_rounding)


@pytest.mark.parametrize("shape", [(4097, 1536), (33, 8960), (3, SINGLE_PASS_MAX_K + 48)])
def test_software_rounding_path_on_cuda(shape):
    x = torch.randn(*shape, device="cuda") * torch.logspace(-6, 6, shape[0], device="cuda")[:, None]
    _assert_bitwise(x.to(torch.bfloat16), software_rounding=True)
    _assert_bitwise(x, software_rounding=True)


def test_clip_counter_and_dispatch_on_cuda():
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = torch.randn(300, 1536, device="cuda", dtype=torch.bfloat16)
    rows = quantize_activations_rowwise_fp8(x, clip_counter=counter)
    assert rows.backend == "triton" and rows.fallback_reason is None
    assert counter.item() == 0
    x[7, 9] = float("inf")
    triton_quantize_rowwise_fp8(x, clip_counter=counter)
    assert counter.item() == 1
