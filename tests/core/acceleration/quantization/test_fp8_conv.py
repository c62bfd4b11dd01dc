"""FP8 implicit-GEMM convolution against its torch reference and against the dense FP32 convolution.

Stated tolerances:

* fast path vs reference (same FP8 operands, different summation order), per element, the derived bound of
  :func:`_error_bound`: ``|a - r| <= 1.01 * (K * u_acc + (K + 8) * u) * (T + |b|)`` with ``u = 2**-24``,
  ``T = conv3d(|x_deq|, |w_deq|)`` (the sum of the magnitudes of the products) and ``u_acc`` the unit roundoff
  of the GEMM's accumulator (``2**-24`` for the CPU's float32 emulation; ``2**-14`` on CUDA, where FP8 tensor
  cores keep about 14 significant bits between promotions to float32). Derivation: every FP8 product
  ``q_x * q_w`` is exact in float32 (4-bit significands); the GEMM sums K of them (``K * u_acc`` relative to
  ``T``), then applies ``s_x`` and, in ``addcmul``, ``s_w`` and the bias (3 roundings). The reference rounds
  ``q_x * s_x``, ``q_w * s_w`` and each product once and sums K terms in float32 (``(K + 3) * u``), plus the
  bias; ``1.01`` covers ``gamma_n = n u / (1 - n u)``. TF32 is off in the reference (cuDNN's default TF32
  rounds both operands to 10 mantissa bits, far outside this bound);
* FP8 vs dense FP32 on Gaussian data: relative L2 below 0.06 (about 0.04 measured; one e4m3 rounding of each
  operand has a relative RMS error of about 2**-4 / sqrt(3)).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.quantization.fp8 import (
    FP8_E4M3_MAX,
    quantize_rowwise_fp8,
    rowwise_error_bound,
)
from worldfoundry.core.acceleration.quantization.fp8_conv import (
    ConvGeometry,
    activation_scale,
    fp8_conv3d,
    fp8_conv3d_reference,
    fp8_gemm_unavailable_reason,
    pack_conv_weight,
    quantize_activation,
    scaled_mm_unavailable_reason,
)
from worldfoundry.errors import QuantizationInputError

needs_scaled_mm = pytest.mark.skipif(scaled_mm_unavailable_reason("cpu") is not None,
                                     reason="torch._scaled_mm has no FP8 CPU path in this torch build")


def _conv(cin: int, cout: int, kernel: tuple[int, int, int], stride: tuple[int, int, int], seed: int) -> torch.nn.Conv3d:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Conv3d(cin, cout, kernel, stride=stride)


def _error_bound(x: torch.Tensor, packed, scale: torch.Tensor, u_acc: float) -> torch.Tensor:
    """Per-element bound of ``|fp8_conv3d - fp8_conv3d_reference|`` (derivation in the module docstring)."""
    g = packed.geometry
    k, u = g.reduction, 2.0**-24
    xq = quantize_activation(x, scale).permute(0, 4, 1, 2, 3).float() * scale
    magnitudes = F.conv3d(xq.abs().double(), packed.dequantized_weight().abs().double(), stride=g.stride)
    bias = packed.bias[: g.out_channels].abs().double().reshape(1, -1, 1, 1, 1)
    return (1.01 * (k * u_acc + (k + 8) * u) * (magnitudes + bias)).float()


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@needs_scaled_mm
@settings(max_examples=12, deadline=None)
@given(cin=st.sampled_from([3, 8, 24]), cout=st.sampled_from([4, 16, 24, 32]),
       kernel=st.sampled_from([(3, 3, 3), (1, 1, 1), (3, 1, 1)]), stride=st.sampled_from([(1, 1, 1), (2, 1, 1)]),
       batch=st.integers(1, 2), seed=st.integers(0, 1000))
def test_scaled_mm_path_matches_reference_and_dense(cin, cout, kernel, stride, batch, seed):
    conv = _conv(cin, cout, kernel, stride, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cin, 5, 6, 7, generator=g)
    scale = torch.tensor(activation_scale(x.abs().max()))
    packed = pack_conv_weight(conv)
    fast = fp8_conv3d(x, packed, scale, workspace_bytes=1 << 12)
    ref = fp8_conv3d_reference(x, packed, scale)
    dense = F.conv3d(x, conv.weight, conv.bias, stride=stride)
    assert fast.shape == ref.shape == dense.shape and fast.dtype == torch.float32
    assert torch.all((fast - ref).abs() <= _error_bound(x, packed, scale, u_acc=2.0**-24))
    assert _rel_l2(ref, dense) < 0.06


@needs_scaled_mm
def test_workspace_chunking_does_not_change_the_result():
    conv = _conv(8, 16, (3, 3, 3), (1, 1, 1), 1)
    x = torch.randn(2, 8, 7, 9, 9, generator=torch.Generator().manual_seed(1))
    scale = torch.tensor(activation_scale(x.abs().max()))
    packed = pack_conv_weight(conv)
    whole = fp8_conv3d(x, packed, scale)
    chunked = fp8_conv3d(x, packed, scale, workspace_bytes=1)  # one output frame per GEMM
    assert torch.allclose(whole, chunked, rtol=0, atol=1e-5 * float(whole.abs().max()))


def test_reference_is_the_dequantized_convolution():
    conv = _conv(24, 24, (3, 3, 3), (1, 1, 1), 2)
    x = torch.randn(1, 24, 4, 6, 6, generator=torch.Generator().manual_seed(2))
    scale = torch.tensor(activation_scale(2.0))  # clips the tail of the Gaussian
    packed = pack_conv_weight(conv)
    xq = ((x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()) * scale
    w = packed.dequantized_weight()
    assert torch.equal(fp8_conv3d_reference(x, packed, scale), F.conv3d(xq, w, conv.bias.detach()))


def test_weight_packing_uses_the_shared_rowwise_definition():
    conv = _conv(3, 24, (3, 3, 3), (1, 1, 1), 3)
    packed = pack_conv_weight(conv)
    assert packed.qweight.shape == (32, 96) and packed.qweight.dtype == torch.float8_e4m3fn  # N 24->32, K 81->96
    assert torch.count_nonzero(packed.qweight[24:].float()) == 0 and torch.count_nonzero(packed.qweight[:, 81:].float()) == 0
    matrix = conv.weight.detach().permute(0, 2, 3, 4, 1).reshape(24, 81)
    q, s = quantize_rowwise_fp8(matrix)
    assert torch.equal(packed.qweight[:24, :81].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(packed.weight_scale[:24], s.reshape(-1))
    err = (packed.dequantized_weight() - conv.weight.detach()).abs().permute(0, 2, 3, 4, 1).reshape(24, 81)
    assert bool((err.double() <= rowwise_error_bound(matrix, s)).all())


def test_activation_quantization_is_channels_last_and_clamped():
    x = torch.tensor([0.5, -1.0, 3.0, -7.0]).view(1, 4, 1, 1, 1)
    scale = torch.tensor(activation_scale(1.0))
    q = quantize_activation(x, scale)
    assert q.shape == (1, 1, 1, 1, 4) and q.dtype == torch.float8_e4m3fn
    assert (q.float().reshape(-1) * scale).tolist() == pytest.approx([0.5, -1.0, 1.0, -1.0], abs=1e-6)


def test_geometry_of_a_causal_conv_round_trips_and_rejects_unsupported_convs():
    conv = WanCausalConv3d(24, 48, 3, padding=1)
    geometry = ConvGeometry.from_conv(conv)
    assert geometry.pad == (1, 1, 1, 1, 2, 0) and geometry.reduction == 24 * 27
    assert ConvGeometry.from_json(geometry.to_json()) == geometry
    with pytest.raises(QuantizationInputError, match="groups=2"):
        ConvGeometry.from_conv(torch.nn.Conv3d(4, 4, 3, groups=2))
    with pytest.raises(QuantizationInputError, match="padding"):
        ConvGeometry.from_conv(torch.nn.Conv3d(4, 4, 3, padding=1))
    with pytest.raises(QuantizationInputError, match="malformed"):
        ConvGeometry.from_json({"in_channels": 4})


def test_input_checks_and_scales():
    packed = pack_conv_weight(_conv(8, 16, (3, 3, 3), (1, 1, 1), 4))
    with pytest.raises(QuantizationInputError, match=r"\(B, 8, T, H, W\)"):
        fp8_conv3d_reference(torch.zeros(1, 4, 3, 3, 3), packed, torch.tensor(1.0))
    with pytest.raises(QuantizationInputError, match="smaller than the kernel"):
        fp8_conv3d(torch.zeros(1, 8, 2, 3, 3), packed, torch.tensor(1.0))
    with pytest.raises(QuantizationInputError, match="amax"):
        activation_scale(float("nan"))
    assert activation_scale(0.0) > 0
    assert activation_scale(448.0) == 1.0


def test_cpu_has_no_fp8_gemm_for_acceleration():
    reason = fp8_gemm_unavailable_reason("cpu")
    assert reason is not None and "cpu" in reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or fp8_gemm_unavailable_reason("cuda") is not None,
                    reason="needs CUDA with FP8 tensor cores (sm_89+)")
def test_cuda_scaled_mm_matches_the_reference():
    conv = _conv(24, 48, (3, 3, 3), (1, 1, 1), 5).cuda()
    x = torch.randn(1, 24, 6, 34, 50, generator=torch.Generator().manual_seed(5)).cuda()
    scale = torch.tensor(activation_scale(x.abs().max()), device="cuda")
    packed = pack_conv_weight(conv)
    fast = fp8_conv3d(x, packed, scale, workspace_bytes=1 << 20)
    tf32 = torch.backends.cudnn.allow_tf32
    ref = fp8_conv3d_reference(x, packed, scale)
    assert torch.backends.cudnn.allow_tf32 == tf32  # the reference restores the global flag
    assert torch.all((fast - ref).abs() <= _error_bound(x, packed, scale, u_acc=2.0**-14))
    assert _rel_l2(ref, F.conv3d(x, conv.weight, conv.bias)) < 0.06
