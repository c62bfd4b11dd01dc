"""The strides PyTorch gives the output of an elementwise op (TensorIterator's choice), from operand strides alone.

A fused kernel that replaces eager elementwise ops must hand the next op the layout eager would have handed it
(convolutions pick their algorithms, and so their rounding, by memory format). For operands of one shape
(no broadcasting) and one dtype, ``TensorIteratorBase::build`` allocates a fresh output so:

1. *fast setup*: every input contiguous -> a contiguous output; else every input channels-last contiguous (4-D)
   -> channels-last; else every input non-overlapping and dense with equal strides -> those strides;
2. otherwise ``reorder_dimensions``: an insertion sort of the dimensions, fastest first, comparing the inputs'
   strides in operand order (a zero stride skips that input; equal strides put the smaller size first), and the
   output is dense in that order (``compatible_stride``), or plainly contiguous when the order is the identity.

The meta device is not used: its Python elementwise references choose strides of size-1 dimensions differently.

Example:
    >>> import torch
    >>> x = torch.empty(2, 8, 3, 5).to(memory_format=torch.channels_last)
    >>> h, g = x.chunk(2, dim=1)
    >>> elementwise_strides(h.shape, [h.stride()])
    (60, 1, 20, 4)
"""

from __future__ import annotations

from collections.abc import Sequence

Shape = Sequence[int]
Strides = Sequence[int]


def contiguous_strides(shape: Shape) -> tuple[int, ...]:
    """``torch.empty(shape).stride()``."""
    strides = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def channels_last_strides(shape: Shape) -> tuple[int, ...]:
    """``torch.empty(shape, memory_format=torch.channels_last).stride()`` of a 4-D shape."""
    _, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _dense_in_order(shape: Shape, strides: Strides, order: Sequence[int]) -> bool:
    expected = 1
    for d in order:
        if shape[d] != 1:
            if strides[d] != expected:
                return False
            expected *= shape[d]
    return True


def is_contiguous(shape: Shape, strides: Strides) -> bool:
    """``Tensor.is_contiguous()`` from sizes and strides (size-1 dimensions ignored)."""
    return any(s == 0 for s in shape) or _dense_in_order(shape, strides, range(len(shape) - 1, -1, -1))


def is_channels_last(shape: Shape, strides: Strides) -> bool:
    """``Tensor.is_contiguous(memory_format=torch.channels_last)`` (4-D only; other ranks: ``False``)."""
    if len(shape) != 4:
        return False
    return any(s == 0 for s in shape) or _dense_in_order(shape, strides, (1, 3, 2, 0))


def is_non_overlapping_and_dense(shape: Shape, strides: Strides) -> bool:
    """``TensorImpl::is_non_overlapping_and_dense`` from sizes and strides."""
    if len(shape) == 1:
        return shape[0] < 2 or strides[0] == 1
    order = sorted(range(len(shape)), key=lambda d: (shape[d] < 2, strides[d]))
    expected = 1
    for d in order:
        if shape[d] < 2:
            return True
        if strides[d] != expected:
            return False
        expected *= shape[d]
    return True


def _reorder(shape: Shape, inputs: Sequence[Strides]) -> list[int]:
    """``reorder_dimensions``' permutation (fastest dimension first)."""
    nd = len(shape)
    perm = list(range(nd - 1, -1, -1))

    def should_swap(d0: int, d1: int) -> int:
        for strides in inputs:
            s0, s1 = strides[d0], strides[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    for i in range(1, nd):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    return perm


def elementwise_strides(shape: Shape, inputs: Sequence[Strides]) -> tuple[int, ...]:
    """The strides of the fresh output of an elementwise op over ``inputs`` (same shape, same dtype).

    Args:
        shape: the common shape.
        inputs: each input's strides, in operand order (``a * b``: ``a`` first).

    Returns:
        The output's strides, as TensorIterator allocates it (see the module docstring).
    """
    shape = tuple(shape)
    if all(is_contiguous(shape, s) for s in inputs):
        return contiguous_strides(shape)
    if all(is_channels_last(shape, s) for s in inputs):
        return channels_last_strides(shape)
    if all(is_non_overlapping_and_dense(shape, s) for s in inputs) and all(
            tuple(s) == tuple(inputs[0]) for s in inputs):
        return tuple(inputs[0])
    if len(shape) <= 1:
        return contiguous_strides(shape)
    perm = _reorder(shape, inputs)
    if perm == list(range(len(shape) - 1, -1, -1)):
        return contiguous_strides(shape)
    out = [0] * len(shape)
    acc = 1
    for d in perm:
        out[d] = acc
        acc *= shape[d]
    return tuple(out)


__all__ = [
    "channels_last_strides",
    "contiguous_strides",
    "elementwise_strides",
    "is_channels_last",
    "is_contiguous",
    "is_non_overlapping_and_dense",
]
