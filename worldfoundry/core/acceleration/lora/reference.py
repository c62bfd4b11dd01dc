"""Torch reference of the FP32 LoRA adapter arithmetic (the function every fast kernel must reproduce).

For one projection with base output ``base = W x (+ bias)`` in the activation dtype, the adapter result is

    y = round_to_activation_dtype( float(base) + scale * ((float(x) @ Aᵀ) @ Bᵀ) )

with ``A`` of shape ``(rank, in_features)`` and ``B`` of shape ``(out_features, rank)``. Both adapter GEMMs and
the addition run in FP32 (FP64 when the activations are FP64); only the final sum is rounded to the activation
dtype, once. The base weights are never combined with the adapter.

The work is split in two steps so that projections reading the same input can share the first one:

* :func:`lora_down_reference` — ``t = float(x) @ Aᵀ`` (``A`` may hold several adapters stacked by rows). ``A`` is
  processed in tiles of :data:`RANK_TILE` rows (zero-padded), one GEMM per tile, so a column of ``t`` depends only
  on the tile holding its row of ``A``: an adapter stacked at a tile boundary gets bitwise the columns it would
  get alone (the Triton kernel is built the same way).
* :func:`lora_up_add_reference` — ``y = round(float(base) + scale * t[:, offset:offset + rank] @ Bᵀ)`` in a fixed
  order of FP32 operations (below), which the Triton kernel reproduces bitwise.

Order of the up step in FP32, each step rounded once (``fma`` is the IEEE fused multiply-add, reproduced bitwise
in torch by :func:`~.exact_fma.fma_fp32`)::

    acc = t[:, 0] * B[:, 0]
    acc = fma(t[:, j], B[:, j], acc)      for j = 1 .. rank - 1
    y   = round_to_activation_dtype( fma(acc, scale, float(base)) )

(FP64 activations compute the same order in FP64 with the multiply and add of each step rounded separately.)

Rows are processed in chunks so the temporaries stay below ``chunk_bytes`` whatever the sequence length.
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.core.acceleration.lora.exact_fma import fma_fp32

#: Upper bound of the FP32 temporaries one reference call allocates per chunk of rows (64 MiB).
DEFAULT_CHUNK_BYTES: Final = 64 << 20
#: Rows of ``A`` per GEMM of the down step; stacked adapters start at multiples of it.
RANK_TILE: Final = 16


def padded_rank(rank: int) -> int:
    """``rank`` rounded up to whole :data:`RANK_TILE` tiles (the rows an adapter occupies in a stacked ``A``)."""
    return -(-int(rank) // RANK_TILE) * RANK_TILE


def compute_dtype_for(activation_dtype: torch.dtype) -> torch.dtype:
    """The adapter arithmetic dtype: FP64 for FP64 activations, FP32 for everything else."""
    return torch.float64 if activation_dtype == torch.float64 else torch.float32


def rows_per_chunk(width: int, itemsize: int = 4, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """How many rows of ``width`` elements of ``itemsize`` bytes fit in ``chunk_bytes`` (at least one).

    Args:
        width: elements per row of the widest temporary.
        itemsize: bytes per element of that temporary.
        chunk_bytes: the budget.

    Returns:
        The number of rows per chunk.
    """
    return max(1, int(chunk_bytes) // max(1, int(width) * int(itemsize)))


def lora_down_reference(x2d: torch.Tensor, a: torch.Tensor, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """``t = float(x) @ Aᵀ``, chunked over rows, one GEMM per :data:`RANK_TILE` rows of ``A``.

    Each tile of ``A`` is copied into a fresh zero-padded ``(RANK_TILE, in_features)`` tensor, so the GEMM that
    produces a column of ``t`` has the same shapes and operands whether ``A`` is one adapter or a stack of
    adapters aligned to tiles (see :func:`~.adapter.stack_down_groups`).

    Args:
        x2d: activations ``(rows, in_features)`` in any floating dtype.
        a: adapter down weights ``(rank_total, in_features)`` (FP32; cast to the compute dtype).
        chunk_bytes: bound of the per-chunk FP32 copy of ``x``.

    Returns:
        ``(rows, rank_total)`` in the compute dtype (FP32, or FP64 for FP64 activations).

    Raises:
        ValueError: the shapes do not line up.
    """
    if x2d.dim() != 2 or a.dim() != 2 or x2d.shape[1] != a.shape[1]:
        raise ValueError(f"lora_down: x {tuple(x2d.shape)} and A {tuple(a.shape)} do not match")
    dtype = compute_dtype_for(x2d.dtype)
    rank, features = a.shape
    tiles = []
    for first in range(0, rank, RANK_TILE):
        tile = torch.zeros((RANK_TILE, features), dtype=dtype, device=x2d.device)
        part = a[first:first + RANK_TILE]
        tile[:part.shape[0]] = part.to(device=x2d.device, dtype=dtype)
        tiles.append((first, part.shape[0], tile))
    rows = x2d.shape[0]
    out = torch.empty((rows, rank), dtype=dtype, device=x2d.device)
    step = rows_per_chunk(features, torch.finfo(dtype).bits // 8, chunk_bytes)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        xc = x2d[start:stop].to(dtype)
        for first, count, tile in tiles:
            out[start:stop, first:first + count] = torch.matmul(xc, tile.t())[:, :count]
    return out


def lora_up_add_reference(base2d: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float, *,
                          offset: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """``y = round(float(base) + (t[:, offset:offset + rank] @ Bᵀ) * scale)`` in the order given in the module
    docstring, chunked over rows (every row is computed alone, so chunking never changes a bit).

    Args:
        base2d: the base projection output ``(rows, out_features)``; its dtype is the result dtype.
        t: the down projection ``(rows, rank_total)`` from :func:`lora_down_reference`.
        b: adapter up weights ``(out_features, rank)``.
        scale: the effective adapter scale (alpha/rank already folded in).
        offset: first column of this adapter inside ``t``.
        chunk_bytes: bound of the per-chunk FP32 temporaries.

    Returns:
        A new tensor shaped and typed like ``base2d``.

    Raises:
        ValueError: the shapes do not line up.
    """
    rank = b.shape[1] if b.dim() == 2 else -1
    if (base2d.dim() != 2 or t.dim() != 2 or b.dim() != 2 or t.shape[0] != base2d.shape[0]
            or b.shape[0] != base2d.shape[1] or offset < 0 or offset + rank > t.shape[1]):
        raise ValueError(
            f"lora_up_add: base {tuple(base2d.shape)}, t {tuple(t.shape)}, B {tuple(b.shape)}, offset {offset} do not match"
        )
    dtype = t.dtype
    b = b.to(device=base2d.device, dtype=dtype)
    t = t[:, offset:offset + rank]
    rows = base2d.shape[0]
    out = torch.empty_like(base2d)
    scale_c = torch.tensor(float(scale), dtype=dtype, device=base2d.device)  # FP32 like the kernel's argument
    fma = fma_fp32 if dtype == torch.float32 else _multiply_add
    # about a dozen FP64 temporaries of the chunk's width inside fma_fp32
    step = rows_per_chunk(12 * base2d.shape[1], 8, chunk_bytes)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        tc = t[start:stop]
        acc = tc[:, 0:1] * b[:, 0]
        for j in range(1, rank):
            acc = fma(tc[:, j:j + 1], b[:, j], acc)
        out[start:stop] = fma(acc, scale_c, base2d[start:stop].to(dtype)).to(base2d.dtype)
    return out


def _multiply_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` with two roundings (the FP64 path of the reference; no kernel computes FP64)."""
    return a * b + c


def lora_linear_reference(x: torch.Tensor, base_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, *,
                          chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """The whole adapter step for one projection (both halves), for any leading shape.

    Args:
        x: projection input ``(..., in_features)``.
        base_out: base projection output ``(..., out_features)``.
        a: ``(rank, in_features)``.
        b: ``(out_features, rank)``.
        scale: effective scale.
        chunk_bytes: temporary memory bound.

    Returns:
        ``y`` shaped and typed like ``base_out``.
    """
    t = lora_down_reference(x.reshape(-1, x.shape[-1]), a, chunk_bytes=chunk_bytes)
    y = lora_up_add_reference(base_out.reshape(-1, base_out.shape[-1]), t, b, scale, chunk_bytes=chunk_bytes)
    return y.view(base_out.shape)


def _truncate_to_bf16(a: torch.Tensor) -> torch.Tensor:
    """FP32 values with the low 16 bits cleared (bfloat16 rounded toward zero, kept in FP32; never overflows)."""
    return (a.view(torch.int32) & -65536).view(torch.float32)


def split_bf16x3(a: torch.Tensor) -> torch.Tensor:
    """Split FP32 values into three bfloat16 terms whose FP32 sum is the input.

    ``hi`` and ``mid`` take the leading 8 significant bits of ``a`` and of ``a - hi`` (rounded toward zero, so
    no term overflows), ``lo`` holds the remaining 8 bits. The sum ``hi + mid + lo`` equals ``a`` exactly for
    every finite ``a`` whose terms stay normal (``|a| >= 2**-110``); below that the error is under ``2**-133``.
    With bfloat16 activations every product ``x * term`` is exact in FP32, so a bfloat16 tensor-core GEMM with
    FP32 accumulation over the three terms reproduces FP32 arithmetic.

    Args:
        a: an FP32 tensor of finite values.

    Returns:
        ``(3, *a.shape)`` bfloat16, stacked ``hi, mid, lo``.

    Raises:
        ValueError: ``a`` is not FP32.
    """
    if a.dtype != torch.float32:
        raise ValueError(f"split_bf16x3 expects float32, got {a.dtype}")
    a = a.contiguous()
    hi = _truncate_to_bf16(a)
    rest = a - hi
    mid = _truncate_to_bf16(rest)
    lo = rest - mid
    return torch.stack([hi.to(torch.bfloat16), mid.to(torch.bfloat16), lo.to(torch.bfloat16)]).contiguous()
