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


def _quantize_both_paths(fn, x, **kwargs):
    """``fn(x)`` three times through the launch plans (the first launch compiles, then direct launches) and once
    through Triton's normal path."""
    from worldfoundry.core.fusion.launch import direct_launch

    direct = [fn(x, **kwargs) for _ in range(3)]
    with direct_launch(False):
        normal = fn(x, **kwargs)
    return direct, normal


@pytest.mark.parametrize("activation", [None, "tanh", "none"])
def test_launch_plans_give_the_bytes_of_tritons_normal_path(activation):
    from worldfoundry.core.acceleration.kernels import fp8_rowwise_quant as quant
    from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import triton_gelu_quantize_rowwise_fp8
    from worldfoundry.core.fusion.launch import alignment_mask, launch_path

    assert launch_path() == "direct"
    if activation is None:
        fn = triton_quantize_rowwise_fp8
    else:
        def fn(h, **kw):
            return triton_gelu_quantize_rowwise_fp8(h, activation, **kw)
    wide = torch.randn(4099, 2048, device="cuda", dtype=torch.bfloat16)
    storage = torch.empty(600 * 1536 + 1, device="cuda", dtype=torch.bfloat16)
    misaligned = storage[1:].view(600, 1536)  # 2 bytes past an aligned address: its own specialization
    misaligned.copy_(torch.randn(600, 1536, device="cuda"))
    assert alignment_mask([misaligned]) == 0
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    quant._PLANS.clear()
    same_geometry = torch.randn(3600, 1536, device="cuda")
    for x, kwargs in ((same_geometry.to(torch.bfloat16), {}),
                      (torch.randn(2, 3600, 8960, device="cuda", dtype=torch.bfloat16), {"clip_counter": counter}),
                      (wide[:, 256:1792], {}), (wide[::3, :1536], {}), (misaligned, {}),
                      (same_geometry, {})):  # float32: the same geometry, another plan
        if activation is not None and x.dtype != torch.bfloat16:
            continue
        direct, normal = _quantize_both_paths(fn, x, **kwargs)
        for q, scale in direct:
            assert torch.equal(q.view(torch.uint8), normal[0].view(torch.uint8))
            assert torch.equal(scale, normal[1])
        if activation is None:
            q_ref, scale_ref = quantize_rowwise_fp8(x)
            assert torch.equal(normal[0].view(torch.uint8), q_ref.view(torch.uint8))
            assert torch.equal(normal[1], scale_ref)
    assert counter.item() == 0
    assert len(quant._PLANS) == (6 if activation is None else 5)  # one plan per geometry and input dtype
    assert all(plan.variants() == 1 for plan in quant._PLANS.values())


def test_a_launch_plan_is_captured_by_a_cuda_graph():
    from worldfoundry.core.acceleration.kernels import fp8_rowwise_quant as quant

    x = torch.randn(3600, 1536, device="cuda", dtype=torch.bfloat16)
    quant._PLANS.clear()
    for _ in range(2):
        triton_quantize_rowwise_fp8(x)  # compile, then a direct launch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        q, scale = triton_quantize_rowwise_fp8(x)
    fresh = torch.randn_like(x) * 7
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    q_ref, scale_ref = quantize_rowwise_fp8(fresh)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)
