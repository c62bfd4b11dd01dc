"""FP32 LoRA adapter arithmetic: torch reference, Triton kernels, dispatcher and runtime projection objects.

``y = round(float(base(x)) + scale * ((float(x) @ Aᵀ) @ Bᵀ))`` — the adapter never touches the base weights.
The exact order of the FP32 operations is defined by :mod:`.reference`; the Triton up kernel reproduces it
bitwise, the down kernel within the FP32 bound (and bitwise between stacked and separate adapters).
"""

from __future__ import annotations

from worldfoundry.core.acceleration.lora.adapter import (
    DROPPED_UNUSED,
    GROUP_COMPUTED,
    HANDED_OVER,
    OWN_OTHER_INPUT,
    LoraProjection,
    SharedDownProjection,
    canonical_device,
    stack_down_groups,
)
from worldfoundry.core.acceleration.lora.dispatch import (
    REFERENCE,
    TRITON,
    LoraKernelStats,
    kernel_unavailable_reason,
    lora_down,
    lora_up_add,
)
from worldfoundry.core.acceleration.lora.exact_fma import fma_fp32
from worldfoundry.core.acceleration.lora.reference import (
    DEFAULT_CHUNK_BYTES,
    RANK_TILE,
    compute_dtype_for,
    lora_down_reference,
    lora_linear_reference,
    lora_up_add_reference,
    padded_rank,
    rows_per_chunk,
    split_bf16x3,
)
from worldfoundry.core.acceleration.lora.triton_kernels import (
    HAS_TRITON,
    KERNEL_MAX_RANK,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DROPPED_UNUSED",
    "GROUP_COMPUTED",
    "HANDED_OVER",
    "HAS_TRITON",
    "KERNEL_MAX_RANK",
    "OWN_OTHER_INPUT",
    "RANK_TILE",
    "REFERENCE",
    "TRITON",
    "LoraKernelStats",
    "LoraProjection",
    "SharedDownProjection",
    "canonical_device",
    "compute_dtype_for",
    "fma_fp32",
    "kernel_unavailable_reason",
    "lora_down",
    "lora_down_reference",
    "lora_linear_reference",
    "lora_up_add",
    "lora_up_add_reference",
    "padded_rank",
    "rows_per_chunk",
    "split_bf16x3",
    "stack_down_groups",
]
