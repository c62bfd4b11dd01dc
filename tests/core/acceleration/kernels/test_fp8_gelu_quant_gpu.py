"""The fused GELU + rowwise FP8 kernel on CUDA against torch's CUDA GELU followed by the rowwise definition.

Skipped without a CUDA device. Two claims, tested separately so a failure says which one broke:

* quantization (always bitwise): the FP8 bytes and scales equal ``quantize_rowwise_fp8`` of the kernel's own
  bfloat16 activation, on odd, large (W81: 32,760 x 8,960) and strided shapes, both rounding paths;
* activation (bitwise when Triton's libdevice ``tanhf``/``erff`` equal the ones torch was built with): the
  kernel's activation equals ``F.gelu(h, approximate=...)`` on the same GPU for every element. A failure
  message gives the measured fraction of equal elements and the largest distance in bfloat16 ulps; the
  benchmark (``benchmarks/kernels/selective_fp8.py``) reports the same figures.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worldfoundry.core.acceleration.kernels.dispatch import (
    gelu_quantize_activations_rowwise_fp8,
)
from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import (
    bfloat16_ulp_distance,
    gelu_float64,
    reference_gelu_quantize_rowwise_fp8,
    triton_gelu_quantize_rowwise_fp8,
)
from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import (
    SINGLE_PASS_MAX_K,
    TRITON_AVAILABLE,
)
from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE), reason="needs CUDA and triton"),
]

SHAPES = [
    (1, 16), (3, 1536), (17, 8960), (127, 40), (1023, 8960), (4097, 3072), (32760, 8960), (5, 13824),
    (3, SINGLE_PASS_MAX_K + 48), (9, 3, 8960), (2, 100),
]
APPROXIMATIONS = ["tanh", "none"]


def _inputs(shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    scales = torch.logspace(-2, 1.5, shape[0], device="cuda").reshape(-1, *([1] * (len(shape) - 1)))
    return (torch.randn(*shape, generator=g, device="cuda") * scales).to(torch.bfloat16)


def _quantization_is_bitwise(h: torch.Tensor, approximate: str, **kwargs) -> torch.Tensor:
    q, scale, act = triton_gelu_quantize_rowwise_fp8(h, approximate, return_activation=True, **kwargs)
    q_own, scale_own = quantize_rowwise_fp8(act)
    assert torch.equal(q.view(torch.uint8), q_own.view(torch.uint8))
    assert torch.equal(scale, scale_own)
    q2, scale2 = triton_gelu_quantize_rowwise_fp8(h, approximate, **kwargs)  # without the activation store
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2)
    return act


def _activation_matches_torch(h: torch.Tensor, act: torch.Tensor, approximate: str) -> None:
    dense = F.gelu(h, approximate=approximate)
    ulps = bfloat16_ulp_distance(act, dense)
    equal = (ulps == 0).double().mean().item()
    assert equal == 1.0, (f"activation differs from torch's CUDA GELU: {equal:.6%} of elements equal, max "
                          f"{int(ulps.max())} bf16 ulp")


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantization_bitwise_on_cuda(shape, approximate):
    h = _inputs(shape)
    act = _quantization_is_bitwise(h, approximate)
    bound = 2.0**-8 * gelu_float64(h, approximate).abs() + 2.0**-20 * h.double().abs()
    assert torch.all((act.double() - gelu_float64(h, approximate)).abs() <= bound)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_torch_gelu_then_quantization_on_cuda(shape, approximate):
    h = _inputs(shape)
    q, scale, act = triton_gelu_quantize_rowwise_fp8(h, approximate, return_activation=True)
    _activation_matches_torch(h, act, approximate)
    q_ref, scale_ref = reference_gelu_quantize_rowwise_fp8(h, approximate)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_every_normal_bfloat16_value_on_cuda(approximate):
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = bits[(bits.float().abs() >= 2.0**-100) & (bits.float().abs() <= 1e6)]
    values = torch.cat([values, -values])
    pad = (-values.numel()) % 1000
    h = torch.cat([values, torch.ones(pad, dtype=torch.bfloat16)]).reshape(-1, 1000).cuda()
    act = _quantization_is_bitwise(h, approximate)
    _activation_matches_torch(h, act, approximate)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_software_rounding_and_strided_rows_on_cuda(approximate):
    h = _inputs((4097, 8960))
    act = _quantization_is_bitwise(h, approximate)
    act_sw = _quantization_is_bitwise(h, approximate, software_rounding=True)
    assert torch.equal(act, act_sw)  # explicit bfloat16/e4m3 rounding gives the hardware's bytes
    wide = _inputs((999, 9216))
    _quantization_is_bitwise(wide[:, 128:9088], approximate)
    _quantization_is_bitwise(wide[::3, :8960], approximate)


def test_dispatch_and_clip_counter_on_cuda():
    h = _inputs((300, 8960))
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = gelu_quantize_activations_rowwise_fp8(h, "tanh", clip_counter=counter)
    assert rows.backend == "triton" and rows.fallback_reason is None
    assert counter.item() == 0
    h[7, 9] = float("inf")
    gelu_quantize_activations_rowwise_fp8(h, "tanh", clip_counter=counter)
    assert counter.item() == 1
