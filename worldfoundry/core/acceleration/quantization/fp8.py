"""FP8 e4m3fn rowwise quantization: the definition every fast kernel reproduces bitwise (torch reference).

For a tensor ``x`` whose last dimension has ``K`` elements, each row ``r`` is quantized on its own,
in float32 arithmetic:

.. code-block:: text

    amax[r]  = max_k |x[r, k]|                                    (exact)
    scale[r] = max(amax[r], AMAX_FLOOR) / FP8_E4M3_MAX             (IEEE division, round to nearest)
    inv[r]   = 1 / scale[r]                                        (IEEE division, round to nearest)
    q[r, k]  = e4m3fn(clamp(x[r, k] * inv[r], -448, 448))          (rounded product; cast: nearest even)

and ``float(q[r, k]) * scale[r]`` approximates ``x[r, k]``. Multiplying by the per-row reciprocal (one
division per row instead of one per element) keeps the fused kernel memory-bound. The same function
quantizes Linear weights (rows = output features, one scale per output row) and activations (rows = tokens,
one scale per token).

Error bound (proved from the definition, checked against float64 math in the tests): for every element,
``|x - q * scale| <= max(|x| * (2**-4 + 2**-22), scale * 2**-10 + |x| * 2**-22)``. The first term is half an
e4m3 ulp (3 mantissa bits) of a normal value plus the float32 roundings of the reciprocal and the product
(at most ``2**-23`` relative); the second covers the subnormal range, whose spacing is ``2**-9 * scale``.
With dynamic per-row scaling no finite element can exceed the FP8 range; ``count_clipped`` counts elements
that would (only non-finite inputs do), as a diagnostic.

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, -2.0, 448.0], [0.0, 0.0, 0.0]])
    >>> q, scale = quantize_rowwise_fp8(x)
    >>> q.dtype, scale.shape
    (torch.float8_e4m3fn, torch.Size([2, 1]))
    >>> dequantize_rowwise_fp8(q, scale)[0].tolist()
    [1.0, -2.0, 448.0]
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.errors import QuantizationInputError

#: Storage dtype of every FP8 tensor produced here.
FP8_DTYPE: Final = torch.float8_e4m3fn
#: Largest finite e4m3fn value.
FP8_E4M3_MAX: Final = 448.0
#: Smallest amax used to form a scale, so all-zero rows get a finite, positive scale.
AMAX_FLOOR: Final = 1e-12
#: A scaled magnitude at or above this would round past 448 without saturation (midpoint of 448 and 480):
#: such elements are counted as clipped.
CLIP_THRESHOLD: Final = 464.0
#: Spacing of the e4m3fn subnormals (in units of the row scale).
FP8_E4M3_SUBNORMAL_STEP: Final = 2.0**-9
#: Smallest normal e4m3fn magnitude.
FP8_E4M3_MIN_NORMAL: Final = 2.0**-6
#: Relative half-ulp of a normal e4m3 value (3 mantissa bits).
FP8_E4M3_HALF_ULP: Final = 2.0**-4

_FLOAT_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_input(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise QuantizationInputError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise QuantizationInputError(
            f"{what}: expected a float32/float16/bfloat16/float64 tensor, got {x.dtype}; cast it first"
        )
    if x.dim() < 1 or x.shape[-1] == 0:
        raise QuantizationInputError(f"{what}: expected a tensor with a non-empty last dimension, got {tuple(x.shape)}")


def rowwise_scales(amax: torch.Tensor) -> torch.Tensor:
    """Scales from per-row absolute maxima: ``max(amax, AMAX_FLOOR) / 448`` in float32.

    Args:
        amax: per-row maxima of ``|x|`` (any float dtype, any shape).

    Returns:
        float32 tensor of the same shape.
    """
    amax = amax.to(torch.float32).clamp(min=AMAX_FLOOR)
    # An elementwise tensor divisor: with a Python scalar, CUDA turns the division into a multiplication by the
    # rounded reciprocal (a different result than IEEE division, which the Triton kernel and the CPU compute).
    return amax / torch.full_like(amax, FP8_E4M3_MAX)


def quantize_rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize every row (last dimension) of ``x`` to FP8 e4m3fn with its own float32 scale.

    This is the torch reference of the fused Triton kernel in
    :mod:`worldfoundry.core.acceleration.kernels.fp8_rowwise_quant`; both give the same bytes.

    Args:
        x: float tensor ``[..., K]`` (float32, float16, bfloat16 or float64), any device.

    Returns:
        ``(q, scale)``: ``q`` has ``x``'s shape and dtype ``torch.float8_e4m3fn`` (contiguous);
        ``scale`` is float32 of shape ``[..., 1]``.

    Raises:
        QuantizationInputError: ``x`` is not a float tensor with a non-empty last dimension.
    """
    _check_input(x, "quantize_rowwise_fp8")
    xf = x.to(torch.float32)
    scale = rowwise_scales(xf.abs().amax(dim=-1, keepdim=True))
    q = (xf * torch.reciprocal(scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale


def dequantize_rowwise_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(q) * scale`` computed in float32 (float64 when ``dtype`` is float64), returned as ``dtype``.

    Args:
        q: FP8 e4m3fn tensor ``[..., K]``.
        scale: float32 scales broadcastable against ``q`` (``[..., 1]`` for rowwise).
        dtype: result dtype.

    Returns:
        The dequantized tensor.

    Raises:
        QuantizationInputError: ``q`` is not FP8 e4m3fn.
    """
    if not isinstance(q, torch.Tensor) or q.dtype != FP8_DTYPE:
        raise QuantizationInputError(
            f"dequantize_rowwise_fp8: expected a float8_e4m3fn tensor, got {getattr(q, 'dtype', q)!r}"
        )
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(compute) * scale.to(compute)).to(dtype)


def count_clipped(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Number of elements whose scaled magnitude ``|x * (1 / scale)|`` is not below :data:`CLIP_THRESHOLD`.

    Non-finite elements count as clipped. The count is a 0-dim int64 tensor on ``x``'s device.

    Args:
        x: the tensor that was quantized.
        scale: its per-row scales (``[..., 1]``).

    Returns:
        0-dim int64 tensor.
    """
    scaled = (x.to(torch.float32) * torch.reciprocal(scale.to(torch.float32))).abs()
    return (~(scaled < CLIP_THRESHOLD)).sum()


def rowwise_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on ``|x - dequantize(quantize(x))|`` in float64 (see the module docstring).

    Args:
        x: the tensor that was quantized.
        scale: its per-row scales.

    Returns:
        float64 tensor shaped like ``x``.
    """
    ax = x.to(torch.float64).abs()
    s = scale.to(torch.float64)
    normal = ax * (FP8_E4M3_HALF_ULP + 2.0**-22)
    subnormal = s * (FP8_E4M3_SUBNORMAL_STEP / 2) + ax * 2.0**-22
    return torch.maximum(normal, subnormal)


__all__ = [
    "AMAX_FLOOR",
    "CLIP_THRESHOLD",
    "FP8_DTYPE",
    "FP8_E4M3_HALF_ULP",
    "FP8_E4M3_MAX",
    "FP8_E4M3_MIN_NORMAL",
    "FP8_E4M3_SUBNORMAL_STEP",
    "count_clipped",
    "dequantize_rowwise_fp8",
    "quantize_rowwise_fp8",
    "rowwise_error_bound",
    "rowwise_scales",
]
