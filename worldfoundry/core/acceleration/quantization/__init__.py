"""Quantization numerics shared by the quantization plugins (each fast path has a torch reference).

* :mod:`.fp8` — FP8 e4m3fn rowwise quantization (``quantize_rowwise_fp8(x) -> (q, scale)``), scales,
  dequantization, clip counting and the stated error bound.
* :mod:`.fp8_linear` — rowwise FP8 Linear on ``torch._scaled_mm`` (``quantize_weight_rowwise_fp8``,
  ``fp8_rowwise_linear``, ``fp8_rowwise_linear_reference``, ``fp8_linear_fallback_reason``).
* :mod:`.fp8_conv` — FP8 3-D convolution as an implicit GEMM (static activation scale).

The names of :mod:`.fp8` and :mod:`.fp8_linear` are importable from this package; :mod:`.fp8_linear` is
loaded on first use so that :mod:`worldfoundry.core.acceleration.kernels` (which depends on :mod:`.fp8`)
never imports in a cycle.

Example:
    >>> import torch
    >>> from worldfoundry.core.acceleration.quantization import quantize_rowwise_fp8
    >>> q, scale = quantize_rowwise_fp8(torch.randn(4, 32))
"""

from __future__ import annotations

import importlib
from typing import Any

from worldfoundry.core.acceleration.quantization.fp8 import (
    AMAX_FLOOR,
    CLIP_THRESHOLD,
    FP8_DTYPE,
    FP8_E4M3_MAX,
    count_clipped,
    dequantize_rowwise_fp8,
    quantize_rowwise_fp8,
    rowwise_error_bound,
    rowwise_scales,
)

_LAZY = {
    "FP8RowwiseWeight",
    "fp8_linear_fallback_reason",
    "fp8_rowwise_linear",
    "fp8_rowwise_linear_reference",
    "misaligned_dims",
    "quantize_weight_rowwise_fp8",
    "scaled_mm_rowwise",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module("worldfoundry.core.acceleration.quantization.fp8_linear")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AMAX_FLOOR",
    "CLIP_THRESHOLD",
    "FP8_DTYPE",
    "FP8_E4M3_MAX",
    "count_clipped",
    "dequantize_rowwise_fp8",
    "quantize_rowwise_fp8",
    "rowwise_error_bound",
    "rowwise_scales",
    *sorted(_LAZY),
]
