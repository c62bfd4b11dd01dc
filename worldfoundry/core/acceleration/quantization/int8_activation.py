"""Per-token dynamic INT8 activation quantization with an optional per-input-channel smoothing factor.

For rows ``x[m, :]`` (tokens) and a smoothing vector ``inv_smooth[k] = 1 / λ[k]``:

.. code-block:: text

    x̂[m, k]  = float32(x[m, k]) * inv_smooth[k]               (one rounded product)
    a[m]     = max(max_k |x̂[m, k]|, 1e-12)
    scale[m] = a[m] / 127                                      (IEEE division, stored float32)
    q[m, k]  = clamp(round_half_even(x̂[m, k] * (127 / a[m])), -127, 127)

This is the torch reference; the Triton kernel
(:mod:`worldfoundry.core.acceleration.kernels.int8_act_quant`) computes the same operations in the same
order and gives the same bytes and scales for every finite input. Both divisions are tensor-by-tensor IEEE
divisions on purpose: ``127 / amax`` written with a Python number is ``reciprocal(amax) * 127`` in torch, and
``amax / 127`` on CUDA is ``amax * (1 / 127)`` (each rounds twice and differs from the kernel by one ulp at
times, which moves a few codes by one).

Example:
    >>> import torch
    >>> q, scale = quantize_rows_int8(torch.tensor([[1.0, -2.0, 0.5]]))
    >>> q.tolist(), round(float(scale), 6)
    ([[64, -127, 32]], 0.015748)
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.errors import QuantizationInputError

#: Largest INT8 code used (symmetric range).
INT8_MAX: Final = 127.0
#: Smallest row maximum used to form a scale (all-zero rows get codes 0 and a tiny positive scale).
INT8_AMAX_FLOOR: Final = 1e-12


def smoothed_rows(x: torch.Tensor, inv_smooth: torch.Tensor | None) -> torch.Tensor:
    """``float32(x) * inv_smooth`` as ``[M, K]`` float32 (``x`` is flattened to rows)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    return rows if inv_smooth is None else rows * inv_smooth.float()


def quantize_rows_int8(x: torch.Tensor, inv_smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference per-token INT8 quantization (see the module docstring).

    Args:
        x: float tensor ``[..., K]``.
        inv_smooth: optional float32 ``[K]`` multiplied into every row before quantization.

    Returns:
        ``(q int8 [M, K], scale float32 [M, 1])`` with ``M`` = number of rows.

    Raises:
        QuantizationInputError: not a float tensor, or ``inv_smooth`` has the wrong length.
    """
    _check_rows(x, inv_smooth, "quantize_rows_int8")
    rows = smoothed_rows(x, inv_smooth)
    return quantize_rows_int8_with_max(rows, rows.abs().amax(dim=-1, keepdim=True).clamp_min(INT8_AMAX_FLOOR))


def quantize_rows_int8_with_max(rows: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token INT8 codes of float32 ``rows [M, K]`` against given row magnitudes ``amax [M, 1]`` (positive):
    ``scale = amax / 127``, ``q = clamp(round_half_even(rows * (127 / amax)), -127, 127)`` -- the quantizer's
    operations, with the row maximum supplied instead of measured (values above it clamp to ±127)."""
    # Tensor-by-tensor divisions: torch computes ``number / tensor`` as ``reciprocal(tensor) * number`` and, on
    # CUDA, ``tensor / number`` as ``tensor * (1 / number)`` -- two roundings each, unlike the kernel's one.
    limit = torch.full_like(amax, INT8_MAX)
    scale = torch.div(amax, limit)
    rcp = torch.div(limit, amax)
    q = torch.round(rows * rcp).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_rows_int8_grouped(x: torch.Tensor, inv_smooth: torch.Tensor | None, group: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token INT8 with one scale per token **and group of** ``group`` input channels: each group of a row is
    quantized as :func:`quantize_rows_int8` quantizes a whole row (the same float32 operations).

    This is what a producer that quantizes its output tile by tile can emit (one scale per token and tile of
    columns). ``group`` equal to ``K`` gives :func:`quantize_rows_int8`'s codes and scales, bitwise.

    Returns:
        ``(q int8 [M, K], scale float32 [M, K / group])``.

    Raises:
        QuantizationInputError: not a float tensor, a bad ``inv_smooth``, or ``group`` not a positive divisor of
            ``K``.
    """
    _check_rows(x, inv_smooth, "quantize_rows_int8_grouped")
    k = x.shape[-1]
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or k % group:
        raise QuantizationInputError(f"quantize_rows_int8_grouped: group {group!r} must be a positive divisor of "
                                     f"the {k} input channels")
    rows = smoothed_rows(x, inv_smooth).reshape(-1, k // group, group)
    amax = rows.abs().amax(dim=-1, keepdim=True).clamp_min(INT8_AMAX_FLOOR)
    limit = torch.full_like(amax, INT8_MAX)
    q = torch.round(rows * torch.div(limit, amax)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(-1, k), torch.div(amax, limit).reshape(-1, k // group)


def _check_rows(x: torch.Tensor, inv_smooth: torch.Tensor | None, what: str) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise QuantizationInputError(f"{what}: expected a float tensor, got {type(x).__name__}")
    if inv_smooth is not None and inv_smooth.shape != (x.shape[-1],):
        raise QuantizationInputError(f"{what}: inv_smooth has shape {tuple(inv_smooth.shape)}, expected "
                                     f"({x.shape[-1]},)")


def dequantize_rows_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in float32 (the smoothed rows the codes stand for)."""
    return q.float() * scale.float()


__all__ = ["INT8_AMAX_FLOOR", "INT8_MAX", "dequantize_rows_int8", "quantize_rows_int8", "quantize_rows_int8_grouped",
           "quantize_rows_int8_with_max", "smoothed_rows"]
