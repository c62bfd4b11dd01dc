"""Backend choice for rowwise FP8 activation quantization: the Triton kernel on CUDA, the torch reference
otherwise, and the reason whenever the reference ran instead (so receipts can show it).

Both backends compute the same function bitwise (see
:mod:`worldfoundry.core.acceleration.kernels.fp8_rowwise_quant`); only speed differs.
:func:`gelu_quantize_activations_rowwise_fp8` does the same for the fused GELU producer
(:mod:`worldfoundry.core.acceleration.kernels.fp8_gelu_quant`), whose reference is torch's own GELU.

Example:
    >>> import torch
    >>> rows = quantize_activations_rowwise_fp8(torch.randn(3, 32))   # CPU: torch reference
    >>> rows.backend, rows.fallback_reason
    ('torch', 'cpu tensor')
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final, Literal

import torch

from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import (
    reference_gelu_quantize_rowwise_fp8,
    triton_gelu_quantize_rowwise_fp8,
)
from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import (
    TRITON_AVAILABLE,
    interpreter_enabled,
    reference_quantize_rowwise_fp8,
    triton_quantize_rowwise_fp8,
)
from worldfoundry.core.acceleration.quantization.fp8 import count_clipped
from worldfoundry.errors import QuantizationInputError

logger = logging.getLogger(__name__)

Backend = Literal["auto", "triton", "torch"]
BACKENDS: Final = ("auto", "triton", "torch")

#: Reasons reported when the torch reference runs under ``backend="auto"``.
REASON_TRITON_MISSING: Final = "triton not importable"
_logged_reasons: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class QuantizedRows:
    """Result of :func:`quantize_activations_rowwise_fp8`.

    Attributes:
        q: float8_e4m3fn tensor shaped like the input (contiguous).
        scale: float32 per-row scales ``[..., 1]``.
        backend: ``"triton"`` or ``"torch"`` (what actually ran).
        fallback_reason: why the torch reference ran under ``backend="auto"``; ``None`` when the kernel ran
            or the reference was asked for explicitly.
    """

    q: torch.Tensor
    scale: torch.Tensor
    backend: str
    fallback_reason: str | None = None


def triton_unavailable_reason(x: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot run on ``x`` (``None`` when it can).

    Args:
        x: the tensor to quantize.

    Returns:
        ``"triton not importable"``, ``"<device type> tensor"`` (not CUDA, interpreter off) or ``None``.
    """
    if not TRITON_AVAILABLE:
        return REASON_TRITON_MISSING
    if x.device.type != "cuda" and not interpreter_enabled():
        return f"{x.device.type} tensor"
    return None


def quantize_activations_rowwise_fp8(
    x: torch.Tensor, *, clip_counter: torch.Tensor | None = None, backend: Backend = "auto"
) -> QuantizedRows:
    """Quantize the rows of ``x`` to FP8 e4m3fn, choosing the backend.

    ``"auto"`` runs the fused Triton kernel on CUDA tensors and the torch reference on anything else (and on
    CPU tensors even under ``TRITON_INTERPRET=1``, where the kernel would only be slower), returning the
    reason. ``"triton"`` forces the kernel (CPU tensors need ``TRITON_INTERPRET=1``); ``"torch"`` forces the
    reference.

    Args:
        x: float tensor ``[..., K]``.
        clip_counter: optional one-element int32 tensor on ``x``'s device; clipped elements are added to it.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        :class:`QuantizedRows`.

    Raises:
        QuantizationInputError: unknown backend, bad input, or ``"triton"`` requested where it cannot run.
    """
    use_triton, reason = _choose(x, backend)
    if use_triton:
        q, scale = triton_quantize_rowwise_fp8(x, clip_counter=clip_counter)
        return QuantizedRows(q, scale, "triton")
    _log_once(reason, "rowwise FP8 activation quantization")
    q, scale = reference_quantize_rowwise_fp8(x)
    if clip_counter is not None:
        clip_counter += count_clipped(x, scale).to(clip_counter.dtype)
    return QuantizedRows(q, scale, "torch", reason)


def gelu_quantize_activations_rowwise_fp8(
    h: torch.Tensor, approximate: str = "tanh", *, clip_counter: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> QuantizedRows:
    """GELU then rowwise FP8 quantization of ``h`` (bfloat16), choosing the backend as
    :func:`quantize_activations_rowwise_fp8` does.

    ``"triton"`` is the fused kernel (one read of ``h``, no bfloat16 GELU output written); ``"torch"`` is the
    reference ``quantize_rowwise_fp8(F.gelu(h, approximate=approximate))``.

    Args:
        h: bfloat16 tensor ``[..., K]`` (a producer Linear's output).
        approximate: ``"tanh"`` or ``"none"``.
        clip_counter: optional one-element int32 tensor on ``h``'s device; clipped elements are added to it.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        :class:`QuantizedRows` of the activation.

    Raises:
        QuantizationInputError: unknown backend, bad input, unsupported ``approximate`` or ``"triton"``
            requested where it cannot run.
    """
    use_triton, reason = _choose(h, backend)
    if use_triton:
        q, scale = triton_gelu_quantize_rowwise_fp8(h, approximate, clip_counter=clip_counter)
        return QuantizedRows(q, scale, "triton")
    _log_once(reason, "fused GELU + FP8 activation quantization")
    q, scale, g = reference_gelu_quantize_rowwise_fp8(h, approximate, return_activation=True)
    if clip_counter is not None:
        clip_counter += count_clipped(g, scale).to(clip_counter.dtype)
    return QuantizedRows(q, scale, "torch", reason)


def _choose(x: torch.Tensor, backend: str) -> tuple[bool, str | None]:
    """``(use_triton, reason the reference runs under "auto")``."""
    if backend not in BACKENDS:
        raise QuantizationInputError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        reason = REASON_TRITON_MISSING if not TRITON_AVAILABLE else (
            None if x.device.type == "cuda" else f"{x.device.type} tensor"
        )
        return reason is None, reason
    if backend == "triton":
        blocker = triton_unavailable_reason(x)
        if blocker is not None:
            raise QuantizationInputError(f"the Triton backend cannot run here: {blocker}")
        return True, None
    return False, None


def _log_once(reason: str | None, what: str) -> None:
    if reason is not None and (what, reason) not in _logged_reasons:
        _logged_reasons.add((what, reason))
        logger.info("%s uses the torch reference: %s", what, reason)


__all__ = [
    "BACKENDS",
    "REASON_TRITON_MISSING",
    "QuantizedRows",
    "gelu_quantize_activations_rowwise_fp8",
    "quantize_activations_rowwise_fp8",
    "triton_unavailable_reason",
]
