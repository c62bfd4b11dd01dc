"""Backend choice for rowwise FP8 activation quantization: the Triton kernel on CUDA, the torch reference
otherwise, and the reason whenever the reference ran instead (so receipts can show it).

Both backends compute the same function bitwise (see
:mod:`worldfoundry.core.acceleration.kernels.fp8_rowwise_quant`); only speed differs.

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
_logged_reasons: set[str] = set()


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
    if backend not in BACKENDS:
        raise QuantizationInputError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    reason: str | None = None
    if backend == "auto":
        reason = REASON_TRITON_MISSING if not TRITON_AVAILABLE else (
            None if x.device.type == "cuda" else f"{x.device.type} tensor"
        )
        use_triton = reason is None
    elif backend == "triton":
        blocker = triton_unavailable_reason(x)
        if blocker is not None:
            raise QuantizationInputError(f"the Triton backend cannot run here: {blocker}")
        use_triton = True
    else:
        use_triton = False
    if use_triton:
        q, scale = triton_quantize_rowwise_fp8(x, clip_counter=clip_counter)
        return QuantizedRows(q, scale, "triton")
    if reason is not None and reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.info("rowwise FP8 activation quantization uses the torch reference: %s", reason)
    q, scale = reference_quantize_rowwise_fp8(x)
    if clip_counter is not None:
        clip_counter += count_clipped(x, scale).to(clip_counter.dtype)
    return QuantizedRows(q, scale, "torch", reason)


__all__ = [
    "BACKENDS",
    "REASON_TRITON_MISSING",
    "QuantizedRows",
    "quantize_activations_rowwise_fp8",
    "triton_unavailable_reason",
]
