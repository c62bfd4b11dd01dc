"""FP8 (e4m3) 3-D convolution as an implicit GEMM, with a torch reference of the same function.

Numerics (both paths compute the same function up to fp32 summation order):

* activations: one static per-tensor scale ``s_x = max(amax, AMAX_FLOOR) / 448`` from a calibrated ``amax``;
  ``x_q = e4m3(clamp(x / s_x, ±448))``. Inputs beyond the calibrated range are clipped; they are counted with
  the shared :func:`~worldfoundry.core.acceleration.quantization.fp8.count_clipped` definition.
* weights: one scale per output channel, quantized with the shared rowwise definition
  (:func:`~worldfoundry.core.acceleration.quantization.fp8.quantize_rowwise_fp8` on the ``(N, K)`` matrix).
* output: ``y[n] = s_w[n] · (s_x · Σ_k x_q[k] · w_q[n, k]) + bias[n]`` with fp32 accumulation and an fp32
  result (the codec runs in float32; CUDA's rowwise-scaled ``_scaled_mm`` only writes bfloat16, so the GEMM
  uses a tensorwise activation scale and the per-channel weight scale is applied with the bias in one
  ``addcmul``).

The fast path (:func:`fp8_conv3d`) quantizes the input into a channels-last fp8 tensor, gathers the
convolution patches with ``as_strided`` into a zero-padded ``(M, K)`` fp8 matrix (``K = kt·kh·kw·C``, padded
to a multiple of 16) a few output frames at a time, and multiplies with ``torch._scaled_mm``. The reference
(:func:`fp8_conv3d_reference`) dequantizes the same fp8 tensors and calls ``F.conv3d``.

Only ungrouped, undilated convolutions with zero explicit padding are handled (the caller pads, as
diffusers' ``WanCausalConv3d`` does before ``Conv3d._conv_forward``).

Example:
    >>> import torch
    >>> conv = torch.nn.Conv3d(8, 16, 3)
    >>> packed = pack_conv_weight(conv)
    >>> x = torch.randn(1, 8, 3, 6, 6)
    >>> scale = torch.tensor(activation_scale(x.abs().max()))
    >>> tuple(fp8_conv3d_reference(x, packed, scale).shape)
    (1, 16, 1, 4, 4)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.nn.functional as F
from torch import nn

from worldfoundry.core.acceleration.quantization.fp8 import (
    FP8_DTYPE,
    FP8_E4M3_MAX,
    count_clipped,
    quantize_rowwise_fp8,
    rowwise_scales,
)
from worldfoundry.core.acceleration.quantization.fp8_linear import (
    SCALED_MM_ALIGNMENT,
    fp8_device_reason,
)
from worldfoundry.errors import QuantizationInputError

#: Largest im2col workspace (bytes) built at once; larger inputs are processed in chunks of output frames.
DEFAULT_WORKSPACE_BYTES: Final = 256 << 20


def _triple(value: int | Sequence[int]) -> tuple[int, int, int]:
    if isinstance(value, int):
        return (value, value, value)
    out = tuple(int(v) for v in value)
    if len(out) != 3:
        raise QuantizationInputError(f"expected three values for a 3-D convolution, got {value!r}")
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class ConvGeometry:
    """What an FP8 convolution depends on: channels, kernel, stride and the causal padding applied before it.

    ``pad`` is diffusers' ``WanCausalConv3d._padding`` (``F.pad`` order: W, W, H, H, T-front, T-back) or
    zeros for a plain ``Conv3d`` with ``padding=0``.
    """

    in_channels: int
    out_channels: int
    kernel_size: tuple[int, int, int]
    stride: tuple[int, int, int]
    pad: tuple[int, ...]

    @classmethod
    def from_conv(cls, conv: nn.Conv3d) -> ConvGeometry:
        """Geometry of a ``Conv3d`` (or ``WanCausalConv3d``).

        Raises:
            QuantizationInputError: grouped, dilated or explicitly padded convolutions.
        """
        if conv.groups != 1 or tuple(conv.dilation) != (1, 1, 1) or tuple(conv.padding) != (0, 0, 0):
            raise QuantizationInputError(
                f"FP8 convolution supports groups=1, dilation=1 and padding applied by the caller; got "
                f"groups={conv.groups}, dilation={tuple(conv.dilation)}, padding={conv.padding}"
            )
        pad = tuple(int(p) for p in getattr(conv, "_padding", (0,) * 6))
        return cls(conv.in_channels, conv.out_channels, _triple(conv.kernel_size), _triple(conv.stride), pad)

    @property
    def reduction(self) -> int:
        return self.in_channels * math.prod(self.kernel_size)

    def to_json(self) -> dict[str, Any]:
        return {
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "kernel_size": list(self.kernel_size),
            "stride": list(self.stride),
            "pad": list(self.pad),
        }

    @classmethod
    def from_json(cls, data: Any) -> ConvGeometry:
        try:
            return cls(int(data["in_channels"]), int(data["out_channels"]), _triple(data["kernel_size"]),
                       _triple(data["stride"]), tuple(int(p) for p in data["pad"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise QuantizationInputError(f"malformed convolution geometry {data!r}: {exc}") from exc


def fp8_gemm_unavailable_reason(device: torch.device | str) -> str | None:
    """``None`` when the FP8 tensor-core GEMM is usable on ``device``, else a reason for the receipts.

    The device policy is :func:`~worldfoundry.core.acceleration.quantization.fp8_linear.fp8_device_reason`
    (CUDA sm_89+ with ``torch._scaled_mm``), shared with the FP8 Linear path; on a device it allows, the
    convolution's own call (per-tensor scales, float32 output) is tried once
    (:func:`scaled_mm_unavailable_reason`).
    """
    device = torch.device(device)
    reason = fp8_device_reason(device) or scaled_mm_unavailable_reason(device)
    return None if reason is None else f"no FP8 tensor-core GEMM ({reason})"


_PROBES: dict[str, str | None] = {}


def scaled_mm_unavailable_reason(device: torch.device | str) -> str | None:
    """``None`` when ``torch._scaled_mm`` accepts FP8 operands on ``device`` (probed once with 16×16), else why.

    Unlike :func:`fp8_gemm_unavailable_reason` this also accepts CPU builds of torch that emulate FP8 GEMMs;
    use it for verification runs, not to decide on an acceleration.
    """
    device = torch.device(device)
    key = str(device)
    if key not in _PROBES:
        try:
            a = torch.zeros((16, 16), dtype=FP8_DTYPE, device=device)
            one = torch.ones((), dtype=torch.float32, device=device)
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            _PROBES[key] = None
        except Exception as exc:  # any failure of the real call means: not usable here
            _PROBES[key] = f"torch._scaled_mm with FP8 operands is not available on {key}: {exc}"
    return _PROBES[key]


def activation_scale(amax: float | torch.Tensor) -> float:
    """Static per-tensor FP8 scale for an activation whose calibrated absolute maximum is ``amax``."""
    value = float(amax)
    if not math.isfinite(value) or value < 0:
        raise QuantizationInputError(f"activation amax must be finite and non-negative, got {value}")
    return float(rowwise_scales(torch.tensor(value)))


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass
class PackedFp8Conv:
    """An FP8 weight ready for :func:`fp8_conv3d`: ``qweight`` is ``(N_pad, K_pad)`` with K ordered
    ``(kt, kh, kw, C)``; rows and columns beyond ``N``/``K`` are zero."""

    geometry: ConvGeometry
    qweight: torch.Tensor
    weight_scale: torch.Tensor  # (N_pad,) float32, zeros in the padding
    bias: torch.Tensor  # (N_pad,) float32

    @property
    def k(self) -> int:
        return self.geometry.reduction

    @property
    def padded_k(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def padded_n(self) -> int:
        return int(self.qweight.shape[0])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.weight_scale, self.bias))

    def dequantized_weight(self) -> torch.Tensor:
        """The FP8 weight as float32 in ``Conv3d`` layout ``(N, C, kt, kh, kw)`` (for the reference)."""
        g = self.geometry
        w = self.qweight[: g.out_channels, : self.k].float() * self.weight_scale[: g.out_channels, None]
        return w.view(g.out_channels, *g.kernel_size, g.in_channels).permute(0, 4, 1, 2, 3).contiguous()


def pack_conv_weight(conv: nn.Conv3d) -> PackedFp8Conv:
    """Quantize a ``Conv3d``'s weight row-wise (one scale per output channel) and pad it for ``_scaled_mm``.

    Raises:
        QuantizationInputError: unsupported geometry (see :meth:`ConvGeometry.from_conv`).
    """
    geometry = ConvGeometry.from_conv(conv)
    weight = conv.weight.detach()
    n, k = geometry.out_channels, geometry.reduction
    n_pad, k_pad = _round_up(n, SCALED_MM_ALIGNMENT), _round_up(k, SCALED_MM_ALIGNMENT)
    matrix = weight.permute(0, 2, 3, 4, 1).reshape(n, k)  # K order (kt, kh, kw, C) matches the patches
    q, scale = quantize_rowwise_fp8(matrix)  # one scale per output channel, shape (N, 1)
    qweight = torch.zeros((n_pad, k_pad), dtype=FP8_DTYPE, device=weight.device)
    qweight[:n, :k] = q
    weight_scale = torch.zeros(n_pad, dtype=torch.float32, device=weight.device)
    weight_scale[:n] = scale.reshape(-1)
    bias = torch.zeros(n_pad, dtype=torch.float32, device=weight.device)
    if conv.bias is not None:
        bias[:n] = conv.bias.detach().float()
    return PackedFp8Conv(geometry, qweight, weight_scale, bias)


def quantize_activation(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8(clamp(x / scale, ±448))`` of a ``(B, C, T, H, W)`` tensor, returned channels-last ``(B, T, H, W, C)``."""
    scaled = (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    b, c, t, h, w = scaled.shape
    out = torch.empty((b, t, h, w, c), dtype=FP8_DTYPE, device=x.device)
    out.copy_(scaled.permute(0, 2, 3, 4, 1))
    return out


def _output_size(size: Sequence[int], kernel: Sequence[int], stride: Sequence[int]) -> tuple[int, int, int]:
    out = tuple((s - k) // st + 1 for s, k, st in zip(size, kernel, stride, strict=True))
    if min(out) <= 0:
        raise QuantizationInputError(f"input {tuple(size)} is smaller than the kernel {tuple(kernel)}")
    return out  # type: ignore[return-value]


def _check_input(x: torch.Tensor, packed: PackedFp8Conv) -> None:
    if x.ndim != 5 or x.shape[1] != packed.geometry.in_channels:
        raise QuantizationInputError(
            f"FP8 convolution expects (B, {packed.geometry.in_channels}, T, H, W) input, got {tuple(x.shape)}"
        )


def fp8_conv3d(x: torch.Tensor, packed: PackedFp8Conv, act_scale: torch.Tensor, *,
               workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> torch.Tensor:
    """FP8 implicit-GEMM convolution of an already padded ``(B, C, T, H, W)`` input (fp32 output).

    Args:
        x: input (any floating dtype), padding already applied.
        packed: weight from :func:`pack_conv_weight`, on ``x``'s device.
        act_scale: 0-d float32 tensor, the static activation scale.
        workspace_bytes: bound of one im2col chunk; the output frames are processed in chunks below it.

    Returns:
        ``(B, N, T_out, H_out, W_out)`` float32 (a channels-last view of the GEMM output).

    Raises:
        QuantizationInputError: the input does not fit the packed geometry.
    """
    _check_input(x, packed)
    g = packed.geometry
    kt, kh, kw = g.kernel_size
    st, sh, sw = g.stride
    b, c, t, h, w = x.shape
    to, ho, wo = _output_size((t, h, w), g.kernel_size, g.stride)
    xq = quantize_activation(x, act_scale).view(torch.uint8)  # byte copies below; reinterpreted as fp8 for the GEMM
    sb, s_t, s_h, s_w, s_c = xq.stride()
    patches = xq.as_strided((b, to, ho, wo, kt, kh, kw, c), (sb, st * s_t, sh * s_h, sw * s_w, s_t, s_h, s_w, s_c))
    k, k_pad, n_pad = packed.k, packed.padded_k, packed.padded_n
    rows_per_frame = ho * wo
    frames_per_chunk = max(1, min(to, workspace_bytes // max(1, rows_per_frame * k_pad)))
    out = torch.empty((b, to, ho, wo, n_pad), dtype=torch.float32, device=x.device)
    out_rows = out.view(b, to * rows_per_frame, n_pad)
    workspace = torch.empty((frames_per_chunk * rows_per_frame, k_pad), dtype=torch.uint8, device=x.device)
    if k_pad != k:
        workspace[:, k:].zero_()
    one = torch.ones((), dtype=torch.float32, device=x.device)
    weight_t = packed.qweight.t()
    for bi in range(b):
        for t0 in range(0, to, frames_per_chunk):
            t1 = min(to, t0 + frames_per_chunk)
            rows = (t1 - t0) * rows_per_frame
            target = workspace[:rows]
            target[:, :k].view(t1 - t0, ho, wo, kt, kh, kw, c).copy_(patches[bi, t0:t1])
            gemm = torch._scaled_mm(target.view(FP8_DTYPE), weight_t, scale_a=act_scale, scale_b=one,
                                    out_dtype=torch.float32)
            torch.addcmul(packed.bias, gemm, packed.weight_scale, out=out_rows[bi, t0 * rows_per_frame: t1 * rows_per_frame])
    return out[..., : g.out_channels].permute(0, 4, 1, 2, 3)


def fp8_conv3d_reference(x: torch.Tensor, packed: PackedFp8Conv, act_scale: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`fp8_conv3d`: dequantize the same FP8 tensors and run ``F.conv3d`` in fp32
    (IEEE float32 on CUDA too: cuDNN's default TF32 would round both operands to 10 mantissa bits)."""
    _check_input(x, packed)
    g = packed.geometry
    xq = quantize_activation(x, act_scale).permute(0, 4, 1, 2, 3).float() * act_scale
    with _ieee_fp32_convolution(x.device):
        return F.conv3d(xq, packed.dequantized_weight(), packed.bias[: g.out_channels], stride=g.stride)


@contextlib.contextmanager
def _ieee_fp32_convolution(device: torch.device) -> Iterator[None]:
    """cuDNN convolves float32 in TF32 by default (10-bit mantissa operands); the reference must not."""
    if device.type != "cuda":
        yield
        return
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = previous


__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "FP8_DTYPE",
    "FP8_E4M3_MAX",
    "ConvGeometry",
    "PackedFp8Conv",
    "activation_scale",
    "count_clipped",
    "fp8_conv3d",
    "fp8_conv3d_reference",
    "fp8_gemm_unavailable_reason",
    "pack_conv_weight",
    "quantize_activation",
    "scaled_mm_unavailable_reason",
]
