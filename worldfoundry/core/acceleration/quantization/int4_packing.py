"""Symmetric group-wise INT4 weights and their packed layout (two 4-bit values per byte).

A weight ``R`` of shape ``[N, K]`` (output features x input features) is quantized in groups of ``G``
consecutive input features (``G`` = 64 or 128, ``K`` a multiple of ``G``), one scale per output feature and
group:

.. code-block:: text

    s[g, n] = bfloat16(max_k∈g |R[n, k]| / 7)          (1.0 for an all-zero group)
    q[n, k] = clamp(round_half_even(R[n, k] / s[g, n]), -8, 7)

The scale is rounded to bfloat16 *before* the division, so the stored scale is exactly the one the codes were
computed with. Scales are stored transposed, ``[K / G, N]``, so a kernel reads one group's scales for a tile
of output features contiguously.

**Per output channel** (``group_size = 0``, :data:`PER_CHANNEL`): one scale per output feature for the whole
``K`` (scales ``[1, N]``, the max taken over the row), ``K`` a multiple of :data:`CHANNEL_K_MULTIPLE` (128, the
GEMM's K step). With one scale for all of ``K`` a W4A8 GEMM sums the whole ``K`` in one int32 accumulator and
scales once in its epilogue. Its codes are packed *in pairs*: byte ``j`` of row ``n`` holds ``q[n, 2j]`` in its
low nibble and ``q[n, 2j + 1]`` in its high nibble, so a kernel unpacks a ``[N, B/2]`` byte tile into the two
nibble tiles and interleaves them (``join`` + ``reshape``, no data movement) into one ``[N, B]`` operand in K
order -- one dot product per K step.

Packed layout of group-wise codes (``int8 [N, K / 2]``): within each group, byte ``j`` (``0 <= j < G / 2``) of row ``n`` holds
``q[n, g*G + j]`` in its low nibble and ``q[n, g*G + G/2 + j]`` in its high nibble (two's complement). A kernel
therefore unpacks a group with two shifts, ``lo = (b << 4) >> 4`` and ``hi = b >> 4`` (arithmetic), and
multiplies the two halves of the group with two dot products -- no interleaving in registers.

Example:
    >>> import torch
    >>> w = torch.randn(8, 128)
    >>> packed, scales = quantize_int4_groupwise(w, 64)
    >>> packed.shape, packed.dtype, scales.shape, scales.dtype
    (torch.Size([8, 64]), torch.int8, torch.Size([2, 8]), torch.bfloat16)
    >>> bool((dequantize_int4_groupwise(packed, scales, 64) - w).abs().max() <= scales.float().max() / 2)
    True
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.errors import QuantizationInputError

#: Supported group sizes along ``K`` (scale groups of 64 or 128 input features).
GROUP_SIZES: Final = (64, 128)
#: ``group_size`` value meaning one scale per output channel over the whole ``K``.
PER_CHANNEL: Final = 0
#: Every accepted ``group_size``: per channel, 64, 128.
SCALE_GROUPINGS: Final = (PER_CHANNEL, *GROUP_SIZES)
#: ``K`` of per-channel weights is a multiple of this (the per-channel GEMM's K step).
CHANNEL_K_MULTIPLE: Final = 128
#: Largest code magnitude used by the scale (codes span [-8, 7]; the scale maps the group max to 7).
INT4_MAX: Final = 7
INT4_MIN: Final = -8


def k_multiple(group_size: int) -> int:
    """What ``K`` must be a multiple of: the group size, or :data:`CHANNEL_K_MULTIPLE` per channel."""
    return CHANNEL_K_MULTIPLE if group_size == PER_CHANNEL else group_size


def scale_groups(in_features: int, group_size: int) -> int:
    """Rows of the scale tensor: ``K / G``, or 1 per channel."""
    return 1 if group_size == PER_CHANNEL else in_features // group_size


def describe_grouping(group_size: int) -> str:
    """``"per channel"`` or ``"group G"`` (for messages and receipts)."""
    return "per channel" if group_size == PER_CHANNEL else f"group {group_size}"


def _check_group(k: int, group_size: int, what: str) -> None:
    if isinstance(group_size, bool) or group_size not in SCALE_GROUPINGS:
        raise QuantizationInputError(
            f"{what}: group_size must be 0 (per output channel), 64 or 128, got {group_size!r}")
    block = k_multiple(group_size)
    if k % block:
        what_block = "the per-channel K step" if group_size == PER_CHANNEL else "group_size"
        raise QuantizationInputError(f"{what}: in_features {k} is not a multiple of {what_block} {block}")


def groupwise_scales(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-(group, output feature) scales ``[K / G, N]`` (``[1, N]`` per channel) bfloat16 of a ``[N, K]`` weight.

    Raises:
        QuantizationInputError: not 2-D, or ``K`` not a multiple of a supported ``group_size``.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise QuantizationInputError(f"groupwise_scales: expected a 2-D float weight, got {tuple(weight.shape)}")
    n, k = weight.shape
    _check_group(k, group_size, "groupwise_scales")
    groups = scale_groups(k, group_size)
    amax = weight.detach().float().reshape(n, groups, k // groups).abs().amax(-1)
    scale = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))
    return scale.t().contiguous().to(torch.bfloat16)


def quantize_int4_groupwise(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[N, K]`` to packed INT4 codes and bfloat16 group scales (round half to even).

    Args:
        weight: float tensor ``[out_features, in_features]``.
        group_size: 64 or 128 (input features per scale), or 0 (:data:`PER_CHANNEL`, one scale per row).

    Returns:
        ``(packed int8 [N, K/2], scales bfloat16 [K/G or 1, N])`` on the weight's device.

    Raises:
        QuantizationInputError: bad shape, dtype or group size.
    """
    scales = groupwise_scales(weight, group_size)
    n, k = weight.shape
    groups = scale_groups(k, group_size)
    w = weight.detach().float().reshape(n, groups, k // groups)
    codes = torch.round(w / scales.float().t().unsqueeze(-1)).clamp_(INT4_MIN, INT4_MAX).to(torch.int8)
    return pack_int4(codes.reshape(n, k), group_size), scales


def pack_int4(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """Pack int8 codes in [-8, 7] of shape ``[N, K]`` into ``int8 [N, K/2]`` (layout in the module docstring).

    Raises:
        QuantizationInputError: not int8 2-D, or codes outside [-8, 7].
    """
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise QuantizationInputError(f"pack_int4: expected int8 [N, K] codes, got {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape
    _check_group(k, group_size, "pack_int4")
    if codes.numel() and (int(codes.min()) < INT4_MIN or int(codes.max()) > INT4_MAX):
        raise QuantizationInputError("pack_int4: codes must lie in [-8, 7]")
    if group_size == PER_CHANNEL:
        pairs = codes.reshape(n, k // 2, 2)
        return ((pairs[..., 0] & 0x0F) | (pairs[..., 1] << 4)).contiguous()
    half = group_size // 2
    grouped = codes.reshape(n, k // group_size, group_size)
    lo, hi = grouped[..., :half], grouped[..., half:]
    packed = (lo & 0x0F) | (hi << 4)  # int8 arithmetic: hi << 4 wraps into the high nibble
    return packed.reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``int8 [N, K/2]`` -> int8 codes ``[N, K]``."""
    if packed.dtype != torch.int8 or packed.dim() != 2:
        raise QuantizationInputError(f"unpack_int4: expected int8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    n, k_half = packed.shape
    k = 2 * k_half
    _check_group(k, group_size, "unpack_int4")
    if group_size == PER_CHANNEL:
        return torch.stack([(packed << 4) >> 4, packed >> 4], dim=-1).reshape(n, k)
    half = group_size // 2
    grouped = packed.reshape(n, k // group_size, half)
    lo = (grouped << 4) >> 4
    hi = grouped >> 4
    return torch.cat([lo, hi], dim=-1).reshape(n, k)


def dequantize_int4_groupwise(packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` weight ``codes * scale`` computed in float32, returned as ``dtype``."""
    codes = unpack_int4(packed, group_size)
    n, k = codes.shape
    groups = scale_groups(k, group_size)
    w = codes.float().reshape(n, groups, k // groups) * scales.float().t().unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


__all__ = [
    "CHANNEL_K_MULTIPLE",
    "GROUP_SIZES",
    "PER_CHANNEL",
    "SCALE_GROUPINGS",
    "describe_grouping",
    "k_multiple",
    "scale_groups",
    "INT4_MAX",
    "INT4_MIN",
    "dequantize_int4_groupwise",
    "groupwise_scales",
    "pack_int4",
    "quantize_int4_groupwise",
    "unpack_int4",
]
