"""Offset width of the fused pointwise kernels: 32-bit where every reachable element fits, 64-bit otherwise.

A kernel computes an element's address as ``sum(index_d * stride_d)`` per operand. With 32-bit indices that sum
wraps once an operand's *reachable* range (the largest offset any index can form, from its sizes and strides)
exceeds ``2**31 - 1`` -- which can happen although the logical output is small: a strided AdaLN view into a
``[B, S, 6, C]`` table, or a Q chunk of a packed ``[B, S, 3C]`` QKV output, reaches three to six times more
elements than it holds. :func:`needs_int64` therefore looks at sizes and strides of every operand, and the
kernels widen indices to 64-bit *before* multiplying by a stride when it says so. Small tensors keep 32-bit
arithmetic (cheaper address computation).

Example:
    >>> import torch
    >>> reachable_span(torch.empty(4, 6)[:, ::2])
    21
    >>> needs_int64(torch.empty(2, 3))
    False
"""

from __future__ import annotations

from typing import Final

import torch

#: Largest offset a signed 32-bit index expression can hold.
INT32_MAX: Final = 2**31 - 1


def reachable_span(t: torch.Tensor) -> int:
    """Number of elements between ``t``'s first element and the farthest one its sizes and strides reach, plus one.

    Args:
        t: any strided tensor (zero strides, from broadcasting, reach nothing).

    Returns:
        ``1 + sum((size_d - 1) * |stride_d|)``; ``0`` for an empty tensor.
    """
    if t.is_contiguous():  # the common case, without a Python loop over dimensions
        return t.numel()
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))


def needs_int64(*tensors: torch.Tensor | None, extra: int = 0, limit: int = INT32_MAX) -> bool:
    """Whether a kernel reading/writing ``tensors`` needs 64-bit offsets.

    Args:
        *tensors: the operands (``None`` entries are ignored), as the kernel indexes them.
        extra: another count the kernel forms as an index (e.g. the number of logical elements or rows).
        limit: the largest offset 32-bit arithmetic may form (tests lower it to force the 64-bit path).

    Returns:
        ``True`` when any operand's reachable span, or ``extra``, exceeds ``limit``.
    """
    if extra > limit:
        return True
    return any(t is not None and reachable_span(t) > limit for t in tensors)


__all__ = ["INT32_MAX", "needs_int64", "reachable_span"]
