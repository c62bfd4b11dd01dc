"""The fused GELU + rowwise FP8 kernel against its torch reference and float64 math, under the Triton interpreter.

Claims checked here (CPU, ``TRITON_INTERPRET=1``, small shapes):

* the quantization is bitwise: the kernel's FP8 bytes and scales equal ``quantize_rowwise_fp8`` of the kernel's
  own bfloat16 activation, for both GELU forms, odd widths, several pieces per row, two-pass rows, strided rows;
* the activation is GELU rounded to bfloat16: within ``2**-8 * |gelu| + 2**-20 * |x|`` of the float64 formula
  for every normal bfloat16 input (the same bound torch's own bfloat16 GELU meets), and bitwise equal to torch's
  CPU GELU for at least 99.9 % of all normal bfloat16 values (the kernel evaluates tanh GELU as
  ``x / (1 + 2**z)``, which avoids the cancellation of ``1 + tanh`` that torch's formula has for negative
  inputs, and the interpreter has no libdevice erf; so a few elements differ). The activation is not bitwise
  torch's GELU on CUDA either; the GPU test (``test_fp8_gelu_quant_gpu.py``) checks the bound and records the
  equal fraction.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from worldfoundry.core.acceleration.kernels.dispatch import (
    gelu_quantize_activations_rowwise_fp8,
)
from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import (
    GELU_ERF_ALPHA,
    GELU_TANH_BETA,
    GELU_TANH_EXP2_A,
    GELU_TANH_EXP2_B,
    GELU_TANH_KAPPA,
    bfloat16_ulp_distance,
    gelu_float64,
    reference_gelu_quantize_rowwise_fp8,
    triton_gelu_quantize_rowwise_fp8,
)
from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import (
    SINGLE_PASS_MAX_K,
    TRITON_AVAILABLE,
    interpreter_enabled,
    launch_config,
    row_pieces,
    triton_quantize_rowwise_fp8,
)
from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8
from worldfoundry.errors import QuantizationInputError

pytestmark = pytest.mark.skipif(
    not (TRITON_AVAILABLE and interpreter_enabled()), reason="needs triton with TRITON_INTERPRET=1"
)
APPROXIMATIONS = ["tanh", "none"]


def gelu_bound(h: torch.Tensor, approximate: str) -> torch.Tensor:
    """Half a bfloat16 ulp (at most 2**-8 relative) plus the float32 evaluation error of the formula."""
    return 2.0**-8 * gelu_float64(h, approximate).abs() + 2.0**-20 * h.double().abs()


def kernel(h: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, scale, g = triton_gelu_quantize_rowwise_fp8(h, approximate, return_activation=True)
    assert q.dtype == torch.float8_e4m3fn and q.shape == h.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (*h.shape[:-1], 1)
    assert g.dtype == torch.bfloat16 and g.shape == h.shape
    q_own, scale_own = quantize_rowwise_fp8(g)
    assert torch.equal(q.view(torch.uint8), q_own.view(torch.uint8)), "FP8 bytes differ from quantizing the activation"
    assert torch.equal(scale, scale_own), "scales differ from quantizing the activation"
    return q, scale, g


def test_constants_are_the_float32_roundings_of_the_cuda_kernel_constants():
    assert GELU_TANH_BETA == torch.tensor(0.7978845608028654, dtype=torch.float64).float().item()
    assert GELU_TANH_KAPPA == torch.tensor(0.044715, dtype=torch.float64).float().item()
    assert GELU_ERF_ALPHA == torch.tensor(0.7071067811865476, dtype=torch.float64).float().item()
    # x / (1 + 2**(x * (A + B x^2))) is 0.5 x (1 + tanh(kBeta (x + kKappa x^3))): A = -2 log2(e) kBeta, B = A kKappa
    a = -2.0 * math.log2(math.e) * math.sqrt(2.0 / math.pi)
    assert GELU_TANH_EXP2_A == torch.tensor(a, dtype=torch.float64).float().item()
    assert GELU_TANH_EXP2_B == torch.tensor(a * 0.044715, dtype=torch.float64).float().item()


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("shape", [(1, 16), (7, 40), (3, 2, 33), (65, 24), (5, 100), (2, 1536), (3, 8960)])
def test_quantization_of_the_activation_is_bitwise(shape, approximate):
    g = torch.Generator().manual_seed(sum(shape))
    h = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    _, _, act = kernel(h, approximate)
    assert torch.all((act.double() - gelu_float64(h, approximate)).abs() <= gelu_bound(h, approximate))


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_every_normal_bfloat16_value_against_float64_and_torch(approximate):
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = bits[(bits.float().abs() >= 2.0**-100) & (bits.float().abs() <= 1e6)]
    values = torch.cat([values, -values])
    pad = (-values.numel()) % 1000
    h = torch.cat([values, torch.ones(pad, dtype=torch.bfloat16)]).reshape(-1, 1000)
    _, _, act = kernel(h, approximate)
    dense = F.gelu(h, approximate=approximate)
    bound = gelu_bound(h, approximate)
    assert torch.all((act.double() - gelu_float64(h, approximate)).abs() <= bound)
    assert torch.all((dense.double() - gelu_float64(h, approximate)).abs() <= bound)  # the bound is torch's too
    equal = (bfloat16_ulp_distance(act, dense) == 0).double().mean().item()
    assert equal >= 0.999, equal


def test_reference_is_torch_gelu_then_the_rowwise_definition():
    h = (torch.randn(6, 48) * 4).to(torch.bfloat16)
    for approximate in APPROXIMATIONS:
        q, scale, g = reference_gelu_quantize_rowwise_fp8(h, approximate, return_activation=True)
        assert torch.equal(g, F.gelu(h, approximate=approximate))
        q_ref, scale_ref = quantize_rowwise_fp8(F.gelu(h, approximate=approximate))
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
        assert len(reference_gelu_quantize_rowwise_fp8(h, approximate)) == 2


def test_row_pieces_cover_each_row_without_power_of_two_padding():
    assert row_pieces(1536) == (1024, 512, 0)
    assert row_pieces(8960) == (8192, 512, 256)
    assert row_pieces(100) == (64, 32, 16)
    assert row_pieces(17) == (32, 0, 0)
    for k in [1, 5, 16, 63, 64, 65, 100, 1000, 1536, 3072, 5120, 8960, 13824, SINGLE_PASS_MAX_K]:
        p0, p1, p2 = row_pieces(k)
        assert p0 + p1 + p2 >= k and all(p == 0 or p & (p - 1) == 0 for p in (p0, p1, p2))
        assert p0 + p1 < k or p2 == 0 or k < 64  # the last piece is only there for a remainder
    assert launch_config(8960)["PIECES"] == (8192, 512, 256) and launch_config(8960)["BLOCK_K"] == 8960
    assert launch_config(1536)["BLOCK_M"] == 4  # narrow rows: several rows per program


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_long_rows_take_two_passes_and_strided_rows_work(approximate):
    k = SINGLE_PASS_MAX_K + 40
    assert launch_config(k)["SINGLE_PASS"] is False
    h = torch.randn(2, k).to(torch.bfloat16)
    h[1, -1] = 60.0  # the row maximum sits in the last chunk
    _, scale, _ = kernel(h, approximate)
    assert scale[1, 0].item() == pytest.approx(60.0 / 448.0)
    wide = (torch.randn(9, 100) * 2).to(torch.bfloat16)
    kernel(wide[:, 10:74], approximate)  # evenly spaced rows, row stride 100
    kernel(wide[::2, 3:51], approximate)
    kernel(torch.randn(48, 5).to(torch.bfloat16).t(), approximate)  # inner stride != 1: one copy


def test_launch_config_override_does_not_change_the_bytes():
    h = (torch.randn(33, 96) * 3).to(torch.bfloat16)
    base = triton_gelu_quantize_rowwise_fp8(h, "tanh")
    plain = triton_quantize_rowwise_fp8(h)
    for config in ({"BLOCK_M": 1, "num_warps": 1}, {"BLOCK_M": 16, "num_warps": 8}):
        q, scale = triton_gelu_quantize_rowwise_fp8(h, "tanh", config=config)
        assert torch.equal(q.view(torch.uint8), base[0].view(torch.uint8)) and torch.equal(scale, base[1])
        q, scale = triton_quantize_rowwise_fp8(h, config=config)
        assert torch.equal(q.view(torch.uint8), plain[0].view(torch.uint8)) and torch.equal(scale, plain[1])


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_dispatch_and_clip_counter():
    h = (torch.randn(4, 64) * 3).to(torch.bfloat16)
    rows = gelu_quantize_activations_rowwise_fp8(h, "tanh")
    assert rows.backend == "torch" and rows.fallback_reason == "cpu tensor"
    q_ref, s_ref = reference_gelu_quantize_rowwise_fp8(h, "tanh")
    assert torch.equal(rows.q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(rows.scale, s_ref)
    forced = gelu_quantize_activations_rowwise_fp8(h, "tanh", backend="triton")
    assert forced.backend == "triton" and forced.fallback_reason is None
    explicit = gelu_quantize_activations_rowwise_fp8(h, "none", backend="torch")
    assert explicit.backend == "torch" and explicit.fallback_reason is None
    for backend in ("torch", "triton"):
        counter = torch.zeros(1, dtype=torch.int32)
        x = h.clone()
        gelu_quantize_activations_rowwise_fp8(x, "tanh", clip_counter=counter, backend=backend)
        assert counter.item() == 0
        x[2, 5] = float("inf")  # gelu(inf) = inf -> that row's scale is inf: inf / inf is nan, the rest scale to 0
        gelu_quantize_activations_rowwise_fp8(x, "tanh", clip_counter=counter, backend=backend)
        assert counter.item() == 1, backend


def test_input_validation(monkeypatch):
    with pytest.raises(QuantizationInputError, match="bfloat16"):
        triton_gelu_quantize_rowwise_fp8(torch.randn(2, 16), "tanh")
    with pytest.raises(QuantizationInputError, match="bfloat16"):
        reference_gelu_quantize_rowwise_fp8(torch.randn(2, 16), "tanh")
    with pytest.raises(QuantizationInputError, match="approximate='sigmoid' is not supported"):
        triton_gelu_quantize_rowwise_fp8(torch.ones(2, 16, dtype=torch.bfloat16), "sigmoid")
    with pytest.raises(QuantizationInputError, match="empty last dimension"):
        triton_gelu_quantize_rowwise_fp8(torch.ones(2, 0, dtype=torch.bfloat16), "tanh")
    with pytest.raises(QuantizationInputError, match="int32"):
        triton_gelu_quantize_rowwise_fp8(torch.ones(2, 16, dtype=torch.bfloat16), "tanh",
                                         clip_counter=torch.zeros(1, dtype=torch.int64))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(QuantizationInputError, match="CUDA device"):
        triton_gelu_quantize_rowwise_fp8(torch.ones(2, 16, dtype=torch.bfloat16), "tanh")


def test_empty_batch():
    q, scale = triton_gelu_quantize_rowwise_fp8(torch.randn(0, 32).to(torch.bfloat16), "tanh")
    assert q.shape == (0, 32) and scale.shape == (0, 1)


def test_ulp_distance():
    a = torch.tensor([1.0, -1.0, 0.0, -0.0, 1.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0078125, -1.0, -0.0, 0.0, -1.0], dtype=torch.bfloat16)
    assert bfloat16_ulp_distance(a, b).tolist() == [1, 0, 0, 0, 2 * 0x3F80]
