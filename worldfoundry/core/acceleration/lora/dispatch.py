"""Choose the Triton kernel or the torch reference for each adapter step, and count the choice.

The kernels run on CUDA tensors of bfloat16/float16/float32 with a stacked rank up to
:data:`~.triton_kernels.KERNEL_MAX_RANK`, outside autograd. Everything else (CPU tensors, FP64, larger ranks,
tensors that require gradients, no Triton) runs the torch reference, and the reason is counted in
:class:`LoraKernelStats` so a fallback is always visible. Both paths compute the same FP32 function.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from worldfoundry.core.acceleration.lora.reference import (
    DEFAULT_CHUNK_BYTES,
    lora_down_reference,
    lora_up_add_reference,
)
from worldfoundry.core.acceleration.lora.triton_kernels import (
    HAS_TRITON,
    KERNEL_DTYPES,
    KERNEL_MAX_RANK,
    lora_down_triton,
    lora_up_add_triton,
)

TRITON: str = "triton"
REFERENCE: str = "torch_reference"


class LoraKernelStats:
    """Counts of kernel and reference calls, of the reasons the reference was used, and of shared down steps
    (thread-safe).

    Owned by whoever dispatches (a plugin handle, a benchmark); never global.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.triton_calls = 0
        self.reference_calls = 0
        self.fallback_reasons: dict[str, int] = {}
        self.shared_down: dict[str, int] = {}

    def record(self, impl: str, reason: str | None) -> None:
        with self._lock:
            if impl == TRITON:
                self.triton_calls += 1
            else:
                self.reference_calls += 1
                if reason is not None:
                    self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1

    def record_share(self, event: str, n: int = 1) -> None:
        """Count a shared-down event (see :mod:`~.adapter`: ``group_computed``, ``handed_over``, ...)."""
        with self._lock:
            self.shared_down[event] = self.shared_down.get(event, 0) + n

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "triton_calls": self.triton_calls,
                "reference_calls": self.reference_calls,
                "fallback_reasons": dict(self.fallback_reasons),
                "shared_down": dict(self.shared_down),
            }


def kernel_unavailable_reason(tensor: torch.Tensor, rank_total: int) -> str | None:
    """Why the Triton kernels cannot take ``tensor`` (``None`` when they can).

    Args:
        tensor: the activation (down step) or the base output (up step).
        rank_total: the stacked rank of the step.

    Returns:
        A short reason (``"cpu"``, ``"no_triton"``, ``"dtype_float64"``, ``"rank_above_128"``, ``"autograd"``)
        or ``None``.
    """
    if tensor.device.type != "cuda":
        return tensor.device.type
    if not HAS_TRITON:
        return "no_triton"
    if tensor.dtype not in KERNEL_DTYPES:
        return f"dtype_{str(tensor.dtype).removeprefix('torch.')}"
    if rank_total > KERNEL_MAX_RANK:
        return f"rank_above_{KERNEL_MAX_RANK}"
    if torch.is_grad_enabled() and tensor.requires_grad:
        return "autograd"
    return None


def _rows_with_unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1, tensor.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def lora_down(x: torch.Tensor, a: torch.Tensor, a_bf16x3: torch.Tensor | None, stats: LoraKernelStats | None = None,
              *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """``t = float(x) @ Aᵀ`` on the best available path.

    Args:
        x: activations ``(..., in_features)``.
        a: ``(rank_total, in_features)`` FP32 on ``x``'s device.
        a_bf16x3: ``split_bf16x3(a)`` on ``x``'s device (used with bfloat16 activations), or ``None``.
        stats: where the choice is counted.
        chunk_bytes: temporary-memory bound of the reference path.

    Returns:
        ``(rows, rank_total)`` FP32 (FP64 for FP64 activations).
    """
    x2d = _rows_with_unit_stride(x)
    reason = kernel_unavailable_reason(x2d, a.shape[0])
    if reason is None:
        t = lora_down_triton(x2d, a, a_bf16x3)
        impl = TRITON
    else:
        t = lora_down_reference(x2d, a, chunk_bytes=chunk_bytes)
        impl = REFERENCE
    if stats is not None:
        stats.record(impl, reason)
    return t


def lora_up_add(base_out: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float,
                stats: LoraKernelStats | None = None, *, offset: int = 0,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """``y = round(float(base) + scale * t[:, offset:offset + rank] @ Bᵀ)`` on the best available path.

    Args:
        base_out: the base projection output ``(..., out_features)``.
        t: the down projection from :func:`lora_down` (rows match ``base_out``'s leading dims).
        b: ``(out_features, rank)`` FP32 on the same device.
        scale: effective adapter scale.
        stats: where the choice is counted.
        offset: first column of this adapter inside ``t``.
        chunk_bytes: temporary-memory bound of the reference path.

    Returns:
        A new tensor shaped and typed like ``base_out``.
    """
    base2d = _rows_with_unit_stride(base_out)
    reason = kernel_unavailable_reason(base2d, b.shape[1])
    if reason is None and t.dtype != torch.float32:
        reason = f"dtype_{str(t.dtype).removeprefix('torch.')}"
    if reason is None:
        y = lora_up_add_triton(base2d, t, b, scale, offset=offset)
        impl = TRITON
    else:
        y = lora_up_add_reference(base2d, t, b, scale, offset=offset, chunk_bytes=chunk_bytes)
        impl = REFERENCE
    if stats is not None:
        stats.record(impl, reason)
    return y.view(base_out.shape)
