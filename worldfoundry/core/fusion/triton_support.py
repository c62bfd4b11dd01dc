"""Triton availability and the launch options shared by the fusion kernels.

On CUDA the kernels run compiled; on the CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1``,
the CI setting). :func:`unavailable_reason` says why a tensor cannot take the kernel path, which the callers
report as a fallback reason.

The interpreter rounds float32 to bfloat16 differently from the hardware conversion (not always to nearest
even), so under the interpreter the kernels round in float32 bit arithmetic first (``SOFTWARE_ROUNDING``) and the
cast only sees values bfloat16 represents exactly. On CUDA the hardware conversion (round to nearest even, as
torch) is used.
"""

from __future__ import annotations

import os
from typing import Any, Final

import torch

try:  # triton is an optional dependency (extra "triton")
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

#: True when the ``triton`` package imported.
TRITON_AVAILABLE: Final = triton is not None
#: Output dtypes the kernels store (rounding is reproduced for these only).
SUPPORTED_DTYPES: Final = (torch.bfloat16, torch.float32)
REASON_NO_TRITON: Final = "triton not importable"
REASON_DEVICE: Final = "cpu tensor (set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)"


def interpreter_enabled() -> bool:
    """Whether Triton runs in interpreter mode (``TRITON_INTERPRET=1``), which accepts CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(t: torch.Tensor) -> str | None:
    """Why the kernels cannot run on ``t``'s device (``None`` when they can).

    Args:
        t: a tensor the kernel would read.

    Returns:
        :data:`REASON_NO_TRITON`, :data:`REASON_DEVICE` (a CPU tensor without the interpreter), another device
        type, or ``None``.
    """
    if not TRITON_AVAILABLE:
        return REASON_NO_TRITON
    if t.device.type == "cuda":
        return None
    if t.device.type == "cpu":
        return None if interpreter_enabled() else REASON_DEVICE
    return f"{t.device.type} tensor"


def launch_options(num_warps: int = 4) -> dict[str, Any]:
    """Keyword options of every launch: no floating-point contraction (eager has no FMA in these chains)."""
    return {"num_warps": num_warps, "enable_fp_fusion": False}


def software_rounding() -> bool:
    """Round to bfloat16 in bit arithmetic (interpreter) instead of the hardware conversion (CUDA)."""
    return interpreter_enabled()


if TRITON_AVAILABLE:

    @triton.jit
    def store_rounded(ptr, v, mask, OUT_BF16: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
        """Store float32 ``v`` as the output dtype (bfloat16: round to nearest even; float32: as is)."""
        if OUT_BF16:
            tl.store(ptr, round_bf16(v, SOFTWARE_ROUNDING).to(tl.bfloat16), mask=mask)
        else:
            tl.store(ptr, v, mask=mask)

    @triton.jit
    def round_bf16(v, SOFTWARE_ROUNDING: tl.constexpr):
        """Float32 ``v`` rounded to the nearest bfloat16 value (ties to even), returned as float32."""
        if SOFTWARE_ROUNDING:
            bits = v.to(tl.int32, bitcast=True)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            return tl.where(v != v, v, rounded)  # NaN stays NaN
        return v.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)

else:  # pragma: no cover
    store_rounded = None
    round_bf16 = None

__all__ = [
    "REASON_DEVICE",
    "REASON_NO_TRITON",
    "SUPPORTED_DTYPES",
    "TRITON_AVAILABLE",
    "interpreter_enabled",
    "launch_options",
    "round_bf16",
    "software_rounding",
    "store_rounded",
    "tl",
    "triton",
    "unavailable_reason",
]
