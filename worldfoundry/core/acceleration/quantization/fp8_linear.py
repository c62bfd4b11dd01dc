"""Rowwise FP8 Linear: per-output-row FP8 weights, per-token FP8 activations, ``torch._scaled_mm``, bias.

``y = x @ W.T + b`` becomes, with ``(q_x, s_x) = quantize_rowwise(x)`` (one scale per token) and
``(q_w, s_w) = quantize_rowwise(W)`` (one scale per output feature):

.. code-block:: text

    y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] * q_w[n, k] + b[n]

accumulated in float32 by ``torch._scaled_mm`` and written as bfloat16 (bias added in the GEMM epilogue when
it is bfloat16, otherwise in float32 afterwards). The activation quantization runs the fused Triton kernel
on CUDA (:mod:`worldfoundry.core.acceleration.kernels.dispatch`).

``torch._scaled_mm`` needs ``K`` and ``N`` to be multiples of 16, FP8 tensor cores (CUDA sm_89 or newer)
and a bfloat16 output for rowwise scales. :func:`fp8_linear_fallback_reason` tells a caller when to run its
dense operator instead: the device policy, then one real call of the rowwise kernel on that device (cached),
because support depends on the build (:func:`rowwise_scaled_mm_unavailable_reason`).

Example:
    >>> import torch
    >>> w = quantize_weight_rowwise_fp8(torch.randn(32, 64))
    >>> y = fp8_rowwise_linear_reference(torch.randn(5, 64), w)     # float32 math on the FP8 operands
    >>> tuple(y.shape)
    (5, 32)
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Final

import torch

from worldfoundry.core.acceleration.kernels.dispatch import Backend, quantize_activations_rowwise_fp8
from worldfoundry.core.acceleration.quantization.fp8 import FP8_DTYPE, quantize_rowwise_fp8
from worldfoundry.errors import QuantizationInputError

logger = logging.getLogger(__name__)

#: ``torch._scaled_mm`` needs both weight dimensions to be multiples of this.
SCALED_MM_ALIGNMENT: Final = 16
#: Minimum CUDA compute capability with FP8 tensor cores.
FP8_MIN_CAPABILITY: Final = (8, 9)

#: Receipt reasons (stable strings, aggregated by the ledger).
REASON_GPU_LACKS_FP8: Final = "gpu lacks fp8"
REASON_NO_SCALED_MM: Final = "torch._scaled_mm unavailable"


@dataclass(frozen=True)
class FP8RowwiseWeight:
    """A Linear weight quantized once, in the layout ``torch._scaled_mm`` consumes.

    Attributes:
        qweight: ``[N, K]`` float8_e4m3fn, row-major (``qweight.t()`` is the column-major ``mat2``).
        scale: ``[1, N]`` float32, one scale per output row (``scale_b``).
    """

    qweight: torch.Tensor
    scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the FP8 weight and its scales."""
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` weight as ``dtype`` (float32 math)."""
        return (self.qweight.to(torch.float32) * self.scale.reshape(-1, 1)).to(dtype)


def quantize_weight_rowwise_fp8(weight: torch.Tensor) -> FP8RowwiseWeight:
    """Quantize a ``[N, K]`` Linear weight with one scale per output row (torch reference numerics).

    Args:
        weight: float tensor ``[out_features, in_features]`` (gradients are not tracked).

    Returns:
        :class:`FP8RowwiseWeight` on the weight's device.

    Raises:
        QuantizationInputError: the weight is not a 2-D float tensor.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise QuantizationInputError(
            f"quantize_weight_rowwise_fp8: expected a 2-D weight, got shape {tuple(getattr(weight, 'shape', ()))}"
        )
    with torch.no_grad():
        q, scale = quantize_rowwise_fp8(weight.detach())
    return FP8RowwiseWeight(q.contiguous(), scale.reshape(1, -1).contiguous())


@functools.lru_cache(maxsize=64)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_device_reason(device: torch.device) -> str | None:
    """The device policy alone: why FP8 GEMMs are not chosen on ``device`` (``None`` when they may be).

    Args:
        device: where the operands live.

    Returns:
        ``"<type> device"`` for non-CUDA devices, ``"torch._scaled_mm unavailable"`` for a torch without it,
        ``"gpu lacks fp8"`` below sm_89, else ``None``. Nothing is executed.
    """
    if device.type != "cuda":
        return f"{device.type} device"
    if not hasattr(torch, "_scaled_mm"):
        return REASON_NO_SCALED_MM
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _capability(index) < FP8_MIN_CAPABILITY:
        return REASON_GPU_LACKS_FP8
    return None


def fp8_linear_fallback_reason(device: torch.device, *, use_fast_accum: bool = False) -> str | None:
    """Why the FP8 GEMM does not run on ``device`` (``None`` when it does).

    The device policy (:func:`fp8_device_reason`) first; on a device it allows, the real call is tried once
    (:func:`rowwise_scaled_mm_unavailable_reason`), so a torch build without the rowwise kernel falls back
    with the probe's reason instead of failing inside a forward.

    Args:
        device: where the operands live.
        use_fast_accum: the accumulation mode the caller will use (probed as such).

    Returns:
        The policy reason, the probe's reason, or ``None``.
    """
    reason = fp8_device_reason(device)
    if reason is not None:
        return reason
    return rowwise_scaled_mm_unavailable_reason(device, use_fast_accum=use_fast_accum)


_PROBE_ROWS: Final = 16
_PROBE_K: Final = 32
_rowwise_probes: dict[tuple[str, bool], str | None] = {}
_probe_lock = threading.Lock()


def rowwise_scaled_mm_unavailable_reason(device: torch.device | str, *, use_fast_accum: bool = False) -> str | None:
    """Try, once per ``(device, use_fast_accum)``, the exact ``torch._scaled_mm`` call of the FP8 Linear.

    The probe multiplies a ``[16, 32]`` float8_e4m3fn matrix by a ``[32, 16]`` one with per-row ``[16, 1]`` and
    per-column ``[1, 16]`` float32 scales, a fused bfloat16 bias and a bfloat16 output (what
    :func:`scaled_mm_rowwise` sends), and checks the result against float32 math. Whether a build supports
    that combination is a property of the build and the device, not of the torch version alone (CPU builds
    of torch 2.13 have a rowwise CPU kernel; the CUDA build of torch 2.11 accepts only per-tensor scales on
    the CPU), so nothing is assumed. The verdict is cached; the check runs outside CUDA-graph capture only
    (during a capture the verdict is not cached and the call is assumed to work, as before the probe).

    Args:
        device: where the operands would live.
        use_fast_accum: the accumulation flag of the real call.

    Returns:
        ``None`` when the call works and is correct, else a one-line reason for the receipts
        (``"rowwise torch._scaled_mm unavailable on cpu: <error>"``).
    """
    device = torch.device(device)
    key = (str(device), bool(use_fast_accum))
    with _probe_lock:
        if key in _rowwise_probes:
            return _rowwise_probes[key]
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    verdict = _run_rowwise_probe(device, bool(use_fast_accum))
    if verdict is not None:
        logger.warning("FP8 rowwise GEMM falls back to dense on %s: %s", device, verdict)
    with _probe_lock:
        _rowwise_probes[key] = verdict
    return verdict


def _run_rowwise_probe(device: torch.device, use_fast_accum: bool) -> str | None:
    """One real rowwise ``_scaled_mm`` on ``device``; ``None`` or why it cannot be used."""
    if not hasattr(torch, "_scaled_mm"):
        return REASON_NO_SCALED_MM
    try:
        with torch.no_grad():
            a = torch.ones((_PROBE_ROWS, _PROBE_K), device=device).to(FP8_DTYPE)
            w = torch.full((_PROBE_ROWS, _PROBE_K), 0.5, device=device).to(FP8_DTYPE)
            scale_a = torch.arange(1, _PROBE_ROWS + 1, dtype=torch.float32, device=device).reshape(-1, 1) / 16
            scale_b = torch.arange(1, _PROBE_ROWS + 1, dtype=torch.float32, device=device).reshape(1, -1) / 8
            bias = torch.ones(_PROBE_ROWS, dtype=torch.bfloat16, device=device)
            out = torch._scaled_mm(a, w.t(), scale_a=scale_a, scale_b=scale_b, bias=bias,
                                   out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)
            expected = (_PROBE_K * 0.5) * scale_a * scale_b + 1.0  # exact in float32, <= 33 in magnitude
            error = float((out.float() - expected).abs().max() / expected.abs().max())
    except Exception as exc:  # any failure of the real call means: do not use it here
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"rowwise torch._scaled_mm unavailable on {device.type}: {message[:160]}"
    if not error <= 2.0**-7:  # one bfloat16 rounding of the output
        return f"rowwise torch._scaled_mm gives wrong results on {device.type} (relative error {error:.3g})"
    return None


def scaled_mm_rowwise(
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: FP8RowwiseWeight,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``torch._scaled_mm`` of already quantized rows against an :class:`FP8RowwiseWeight`, plus bias.

    Args:
        q: ``[M, K]`` float8_e4m3fn, row-major.
        scale: ``[M, 1]`` float32 activation scales.
        weight: the quantized weight (``K`` and ``N`` multiples of 16).
        bias: optional ``[N]``; fused into the GEMM when it has dtype ``out_dtype`` (bfloat16), otherwise added
            in float32 after it.
        out_dtype: output dtype (bfloat16 for rowwise scaling on CUDA).
        use_fast_accum: ``torch._scaled_mm``'s fast accumulation (faster, less accurate on long K).

    Returns:
        ``[M, N]`` tensor of ``out_dtype``.
    """
    fused_bias = bias if bias is not None and bias.dtype == out_dtype else None
    out = torch._scaled_mm(
        q, weight.qweight.t(), scale_a=scale, scale_b=weight.scale, bias=fused_bias,
        out_dtype=out_dtype, use_fast_accum=use_fast_accum,
    )
    if bias is not None and fused_bias is None:
        out = (out.to(torch.float32) + bias.to(torch.float32)).to(out_dtype)
    return out


def fp8_rowwise_linear(
    x: torch.Tensor,
    weight: FP8RowwiseWeight,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
    clip_counter: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """FP8 Linear: quantize the rows of ``x`` (fused kernel on CUDA), ``torch._scaled_mm``, bias.

    Args:
        x: ``[..., K]`` activations (bfloat16 in practice).
        weight: from :func:`quantize_weight_rowwise_fp8`, on ``x``'s device.
        bias: optional ``[N]``.
        out_dtype: output dtype (bfloat16).
        use_fast_accum: passed to ``torch._scaled_mm``.
        clip_counter: optional one-element int32 device tensor; clipped activation elements are added.
        backend: activation quantization backend (``"auto"``: Triton on CUDA, torch reference elsewhere).

    Returns:
        ``[..., N]`` tensor of ``out_dtype``.

    Raises:
        QuantizationInputError: ``x``'s last dimension does not match the weight.
    """
    if x.shape[-1] != weight.in_features:
        raise QuantizationInputError(
            f"fp8_rowwise_linear: input has {x.shape[-1]} features, the weight expects {weight.in_features}"
        )
    rows = quantize_activations_rowwise_fp8(x.reshape(-1, x.shape[-1]), clip_counter=clip_counter, backend=backend)
    out = scaled_mm_rowwise(rows.q, rows.scale, weight, bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    return out.reshape(*x.shape[:-1], weight.out_features)


def fp8_rowwise_linear_reference(
    x: torch.Tensor, weight: FP8RowwiseWeight, bias: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Reference of :func:`fp8_rowwise_linear`: the same FP8 operands dequantized, multiplied in float32.

    Args:
        x: ``[..., K]`` activations.
        weight: the quantized weight.
        bias: optional ``[N]``.
        out_dtype: result dtype (default float32).

    Returns:
        ``[..., N]`` tensor.
    """
    q, scale = quantize_rowwise_fp8(x.reshape(-1, x.shape[-1]))
    a = q.to(torch.float32) * scale
    out = a @ weight.dequantize(torch.float32).t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    out = out.reshape(*x.shape[:-1], weight.out_features)
    return out.to(out_dtype) if out_dtype is not None else out


def misaligned_dims(in_features: int, out_features: int, multiple: int = SCALED_MM_ALIGNMENT) -> list[str]:
    """Which of a Linear's dimensions are not multiples of ``multiple`` (``["in_features=100"]``).

    Args:
        in_features: ``K``.
        out_features: ``N``.
        multiple: required alignment.

    Returns:
        Descriptions of the offending dimensions (empty when aligned).
    """
    bad = []
    if in_features % multiple:
        bad.append(f"in_features={in_features}")
    if out_features % multiple:
        bad.append(f"out_features={out_features}")
    return bad


__all__ = [
    "FP8_DTYPE",
    "FP8_MIN_CAPABILITY",
    "REASON_GPU_LACKS_FP8",
    "REASON_NO_SCALED_MM",
    "SCALED_MM_ALIGNMENT",
    "FP8RowwiseWeight",
    "fp8_device_reason",
    "fp8_linear_fallback_reason",
    "fp8_rowwise_linear",
    "fp8_rowwise_linear_reference",
    "misaligned_dims",
    "quantize_weight_rowwise_fp8",
    "rowwise_scaled_mm_unavailable_reason",
    "scaled_mm_rowwise",
]
