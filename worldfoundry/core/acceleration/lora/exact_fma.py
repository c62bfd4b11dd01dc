"""IEEE fused multiply-add of FP32 tensors in torch: ``round_fp32(a · b + c)`` with a single rounding.

torch has no fused multiply-add operator whose rounding is guaranteed, but GPU kernels use ``fma.rn.f32``. To
reproduce it bitwise on any device, :func:`fma_fp32` evaluates in FP64 with an error-free transformation:

1. ``p = a · b`` in FP64 is exact (two 24-bit significands need 48 bits; FP32 exponents cannot overflow or
   underflow FP64).
2. ``s = p + c`` in FP64 (rounded) and its exact error ``e`` with Knuth's TwoSum, so ``s + e == a·b + c``.
3. ``r = round_fp32(s)``. Every FP32 rounding boundary (a midpoint between two FP32 neighbours) is an FP64
   number, and rounding to FP64 is monotonic, so ``r`` is the correctly rounded value of ``a·b + c`` unless ``s``
   lies exactly on a midpoint while ``e != 0``; then the exact value lies on the side of the midpoint given by
   the sign of ``e``, and that neighbour is returned.

The result equals a hardware FMA for all finite inputs whose exact result does not overflow FP32 (overflow gives
``±inf`` like the hardware). NaN and infinite inputs give NaN/infinity as IEEE arithmetic does (NaN payloads are
not specified).
"""

from __future__ import annotations

import torch


def fma_fp32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``round_fp32(a · b + c)`` rounded once (to nearest, ties to even), broadcasting like ``a * b + c``.

    Args:
        a: FP32 tensor.
        b: FP32 tensor.
        c: FP32 tensor.

    Returns:
        FP32 tensor of the broadcast shape.

    Raises:
        ValueError: an operand is not FP32.

    Example:
        >>> x = torch.tensor([1.0 + 2.0**-23], dtype=torch.float32)
        >>> float(fma_fp32(x, x, -torch.tensor([1.0 + 2.0**-22])))  # the product's low bits survive
        1.4210854715202004e-14
    """
    for name, value in (("a", a), ("b", b), ("c", c)):
        if value.dtype != torch.float32:
            raise ValueError(f"fma_fp32 expects float32 operands, got {name}: {value.dtype}")
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    # TwoSum: e = (p - p') + (c - c') with p' = s - c', c' = s - p — exact, so s + e == p + c
    c_part = s - p
    p_part = s - c_part
    e = (p - p_part) + (c64 - c_part)
    r = s.float()
    r64 = r.double()
    away = torch.where(s > r64, torch.full_like(r, float("inf")), torch.full_like(r, -float("inf")))
    neighbour = torch.nextafter(r, away)
    # s on the midpoint between r and its neighbour toward s (both differences are exact in FP64)
    midpoint = (s != r64) & ((s - r64) * 2 == neighbour.double() - r64) & torch.isfinite(r) & (e != 0)
    beyond = midpoint & ((e > 0) == (s > r64))
    return torch.where(beyond, neighbour, r)
