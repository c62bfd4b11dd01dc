"""Triton kernels of the FP32 LoRA adapter arithmetic (the torch reference is :mod:`.reference`).

Two kernels, both reading their large operand once:

* ``lora_down`` — ``t = x @ Aᵀ`` for up to :data:`KERNEL_MAX_RANK` stacked adapter rows. The activations are
  read once in their own dtype and accumulated in FP32. For bfloat16 activations the FP32 ``A`` is given as
  three bfloat16 terms (:func:`~.reference.split_bf16x3`) and multiplied on the tensor cores: every product
  of two bfloat16 values is exact in FP32 and the accumulator is FP32, so the result is FP32 arithmetic
  without an FP32 copy of the activations. Other activation dtypes use IEEE FP32 dot products.
  ``A`` is processed in tiles of :data:`~.reference.RANK_TILE` rows, each with its own dot product and
  accumulator; every tile runs the same instructions on the same operands whether it is the only tile or one of
  several, so adapters stacked at tile boundaries (Q/K/V reading one input) get bitwise the columns that a
  separate launch for each would give, while ``x`` is read once for all of them.
* ``lora_up_add`` — ``y = round(float(base) + (t[:, offset:offset + rank] @ Bᵀ) * scale)`` with the rank terms
  added one after the other in FP32 (unrolled multiply-adds, no tensor cores, no padding of small ranks), reading
  the base output once and writing ``y`` once. It is compiled without floating-point contraction, so every
  product and sum is rounded exactly as in :func:`~.reference.lora_up_add_reference`, and the result is bitwise
  the reference's. The final rounding to bfloat16 is done with integer operations (round to nearest even), so
  the interpreter and the GPU produce the same bits from the same FP32 sum. Programs are ordered with the column
  tiles of one row block next to each other, so concurrently running programs stream whole rows; ``B`` is read
  as ``Bᵀ`` rows (unit stride along the output features) so its loads are coalesced.

CPU tensors run through Triton's interpreter (``TRITON_INTERPRET=1``, for tests): there the bfloat16 operands of
the dot product are widened to FP32 first (exact) because the interpreter cannot multiply bfloat16 directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch

from worldfoundry.core.acceleration.lora.reference import RANK_TILE

try:  # Triton is optional: without it the dispatcher always uses the torch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

HAS_TRITON: Final = triton is not None
#: Largest stacked rank the down kernel handles in one pass (up to 8 tiles of RANK_TILE rows).
KERNEL_MAX_RANK: Final = 128
#: Activation/output dtypes the kernels accept.
KERNEL_DTYPES: Final = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class DownConfig:
    """Launch configuration of the down kernel (``block_k`` fixes the FP32 summation order of ``t``)."""

    block_m: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class UpConfig:
    """Launch configuration of the up-and-add kernel (any configuration gives the same bits)."""

    block_m: int = 32
    block_n: int = 256
    num_warps: int = 4


DEFAULT_DOWN_CONFIG: Final = DownConfig()
#: Up kernel launch for rank <= 8; larger ranks use :data:`WIDE_RANK_UP_CONFIG` (fewer rows per program, so the
#: unrolled rank terms fit in registers without spilling).
DEFAULT_UP_CONFIG: Final = UpConfig()
WIDE_RANK_UP_CONFIG: Final = UpConfig(block_m=16, block_n=256, num_warps=4)


def default_up_config(rank: int) -> UpConfig:
    """The up kernel's launch configuration for an adapter of ``rank`` (the result does not depend on it)."""
    return DEFAULT_UP_CONFIG if rank <= 8 else WIDE_RANK_UP_CONFIG


if HAS_TRITON:

    @triton.jit
    def _down_tile(x, a_ptr, stride_as, K, rk, k_ok, acc, TILE: tl.constexpr, R: tl.constexpr,
                   SPLIT_BF16: tl.constexpr, WIDEN: tl.constexpr, RT: tl.constexpr):
        # rows TILE*RT .. TILE*RT + RT - 1 of A (rows >= R read as zero), read transposed: (BLOCK_K, RT)
        rr = TILE * RT + tl.arange(0, RT)
        a_mask = k_ok[:, None] & (rr[None, :] < R)
        a_offsets = rr[None, :] * K + rk[:, None]
        if SPLIT_BF16:
            for s in tl.static_range(3):
                a = tl.load(a_ptr + s * stride_as + a_offsets, mask=a_mask, other=0.0)
                if WIDEN:
                    acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, a, acc)
        else:
            a = tl.load(a_ptr + a_offsets, mask=a_mask, other=0.0)
            acc = tl.dot(x.to(tl.float32), a, acc, input_precision="ieee")
        return acc

    @triton.jit
    def _store_tile(t_ptr, rm, row_ok, stride_tm, acc, TILE: tl.constexpr, R: tl.constexpr, RT: tl.constexpr):
        rr = TILE * RT + tl.arange(0, RT)
        tl.store(t_ptr + rm[:, None].to(tl.int64) * stride_tm + rr[None, :], acc,
                 mask=row_ok[:, None] & (rr[None, :] < R))

    @triton.jit
    def _lora_down_kernel(x_ptr, a_ptr, t_ptr, M, K, stride_xm, stride_tm, stride_as,
                          R: tl.constexpr, TILES: tl.constexpr, SPLIT_BF16: tl.constexpr, WIDEN: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, RT: tl.constexpr):
        pid = tl.program_id(0)
        rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rm < M
        # one accumulator per rank tile (at most 8); tiles beyond TILES are compiled out
        acc0 = tl.zeros((BLOCK_M, RT), dtype=tl.float32)
        if TILES > 1:
            acc1 = tl.zeros((BLOCK_M, RT), dtype=tl.float32)
        if TILES > 2:
            acc2 = tl.zeros((BLOCK_M, RT), dtype=tl.float32)
        if TILES > 3:
            acc3 = tl.zeros((BLOCK_M, RT), dtype=tl.float32)
        if TILES > 4:
            acc4 = tl.zeros((BLOCK_M, RT), dtype=tl.float32)
        if TILES > 5:
            acc5 = tl.zeros((BLOCK_M, RT), dtype=tl.float32)
        if TILES > 6:
            acc6 = tl.zeros((BLOCK_M, RT), dtype=tl.float32)
        if TILES > 7:
            acc7 = tl.zeros((BLOCK_M, RT), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc0 = _down_tile(x, a_ptr, stride_as, K, rk, k_ok, acc0, 0, R, SPLIT_BF16, WIDEN, RT)
            if TILES > 1:
                acc1 = _down_tile(x, a_ptr, stride_as, K, rk, k_ok, acc1, 1, R, SPLIT_BF16, WIDEN, RT)
            if TILES > 2:
                acc2 = _down_tile(x, a_ptr, stride_as, K, rk, k_ok, acc2, 2, R, SPLIT_BF16, WIDEN, RT)
            if TILES > 3:
                acc3 = _down_tile(x, a_ptr, stride_as, K, rk, k_ok, acc3, 3, R, SPLIT_BF16, WIDEN, RT)
            if TILES > 4:
                acc4 = _down_tile(x, a_ptr, stride_as, K, rk, k_ok, acc4, 4, R, SPLIT_BF16, WIDEN, RT)
            if TILES > 5:
                acc5 = _down_tile(x, a_ptr, stride_as, K, rk, k_ok, acc5, 5, R, SPLIT_BF16, WIDEN, RT)
            if TILES > 6:
                acc6 = _down_tile(x, a_ptr, stride_as, K, rk, k_ok, acc6, 6, R, SPLIT_BF16, WIDEN, RT)
            if TILES > 7:
                acc7 = _down_tile(x, a_ptr, stride_as, K, rk, k_ok, acc7, 7, R, SPLIT_BF16, WIDEN, RT)
        _store_tile(t_ptr, rm, row_ok, stride_tm, acc0, 0, R, RT)
        if TILES > 1:
            _store_tile(t_ptr, rm, row_ok, stride_tm, acc1, 1, R, RT)
        if TILES > 2:
            _store_tile(t_ptr, rm, row_ok, stride_tm, acc2, 2, R, RT)
        if TILES > 3:
            _store_tile(t_ptr, rm, row_ok, stride_tm, acc3, 3, R, RT)
        if TILES > 4:
            _store_tile(t_ptr, rm, row_ok, stride_tm, acc4, 4, R, RT)
        if TILES > 5:
            _store_tile(t_ptr, rm, row_ok, stride_tm, acc5, 5, R, RT)
        if TILES > 6:
            _store_tile(t_ptr, rm, row_ok, stride_tm, acc6, 6, R, RT)
        if TILES > 7:
            _store_tile(t_ptr, rm, row_ok, stride_tm, acc7, 7, R, RT)

    @triton.jit
    def _round_fp32_to_bf16(y):
        # Round to nearest even on the bit pattern; NaN stays a quiet NaN.
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)  # noqa: PLR0124 - y != y is the NaN test
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _lora_up_add_kernel(base_ptr, t_ptr, b_ptr, out_ptr, M, N, stride_basem, stride_tm, stride_outm,
                            stride_bn, stride_br, scale,
                            R: tl.constexpr, OUT_KIND: tl.constexpr, HW_ROUND: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # column tiles of one row block are neighbours in launch order: running programs stream whole rows
        n_tiles = tl.cdiv(N, BLOCK_N)
        pid = tl.program_id(0)
        pid_m = pid // n_tiles
        pid_n = pid - pid_m * n_tiles
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = tl.max_contiguous(tl.multiple_of(rn, BLOCK_N), BLOCK_N)
        row_ok = rm < M
        col_ok = rn < N  # uniform over aligned vectors when N is a multiple of 16 (Triton specialises that)
        rm64 = rm.to(tl.int64)
        t_rows = t_ptr + rm64 * stride_tm
        b_cols = b_ptr + rn * stride_bn
        mask = row_ok[:, None] & col_ok[None, :]
        base = tl.load(base_ptr + rm64[:, None] * stride_basem + rn[None, :], mask=mask, other=0.0)
        # acc = t0*B0, then fma(tj, Bj, acc) in order, then y = fma(acc, scale, base): each step rounded once
        tc = tl.load(t_rows, mask=row_ok, other=0.0)
        bc = tl.load(b_cols, mask=col_ok, other=0.0)
        acc = tc[:, None] * bc[None, :]
        for j in tl.static_range(1, R):
            tc = tl.load(t_rows + j, mask=row_ok, other=0.0)
            bc = tl.load(b_cols + j * stride_br, mask=col_ok, other=0.0)
            acc = tl.fma(tc[:, None], bc[None, :], acc)
        y = tl.fma(acc, scale, base.to(tl.float32))
        if OUT_KIND == 0:  # bfloat16, round to nearest even
            if HW_ROUND:
                out = y.to(tl.bfloat16)
            else:  # the interpreter's own conversion does not round to nearest even
                out = _round_fp32_to_bf16(y)
        elif OUT_KIND == 1:  # float16
            out = y.to(tl.float16)
        else:  # float32
            out = y
        tl.store(out_ptr + rm64[:, None] * stride_outm + rn[None, :], out, mask=mask)


_OUT_KIND: Final = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the torch reference (worldfoundry.core.acceleration.lora.reference)")


def lora_down_triton(x2d: torch.Tensor, a: torch.Tensor, a_bf16x3: torch.Tensor | None = None, *,
                     config: DownConfig = DEFAULT_DOWN_CONFIG) -> torch.Tensor:
    """``t = x @ Aᵀ`` accumulated in FP32, reading ``x`` once.

    Args:
        x2d: ``(rows, in_features)`` bfloat16/float16/float32 with unit stride along the last dimension.
        a: ``(rank_total, in_features)`` FP32, contiguous, ``rank_total <= KERNEL_MAX_RANK``.
        a_bf16x3: ``split_bf16x3(a)`` (or the same rows of a larger split: rows contiguous, any stride between
            the three terms); when given and ``x2d`` is bfloat16 the tensor-core path is used.
        config: launch configuration.

    Returns:
        ``(rows, rank_total)`` FP32. Column ``j`` depends only on rows ``16⌊j/16⌋ .. 16⌊j/16⌋ + 15`` of ``A``.

    Raises:
        RuntimeError: triton is not installed.
        ValueError: unsupported dtype, layout, shape or rank.
    """
    _require_triton()
    if x2d.dim() != 2 or a.dim() != 2 or x2d.shape[1] != a.shape[1]:
        raise ValueError(f"lora_down_triton: x {tuple(x2d.shape)} and A {tuple(a.shape)} do not match")
    if x2d.dtype not in KERNEL_DTYPES or a.dtype != torch.float32:
        raise ValueError(f"lora_down_triton: unsupported dtypes x={x2d.dtype}, A={a.dtype}")
    if x2d.stride(1) != 1 or not a.is_contiguous():
        raise ValueError("lora_down_triton: x needs unit stride along features and A must be contiguous")
    rank = a.shape[0]
    if rank > KERNEL_MAX_RANK:
        raise ValueError(f"lora_down_triton: stacked rank {rank} exceeds {KERNEL_MAX_RANK}")
    split = a_bf16x3 is not None and x2d.dtype == torch.bfloat16
    if split and (a_bf16x3.shape != (3, *a.shape) or a_bf16x3.dtype != torch.bfloat16
                  or a_bf16x3.stride(2) != 1 or a_bf16x3.stride(1) != a.shape[1]):
        raise ValueError("lora_down_triton: a_bf16x3 must be split_bf16x3(A) (rows contiguous)")
    rows, k = x2d.shape
    t = torch.empty((rows, rank), dtype=torch.float32, device=x2d.device)
    if rows == 0 or rank == 0:
        return t
    grid = (triton.cdiv(rows, config.block_m),)
    _lora_down_kernel[grid](
        x2d, a_bf16x3 if split else a, t, rows, k, x2d.stride(0), t.stride(0),
        a_bf16x3.stride(0) if split else 0,
        R=rank, TILES=triton.cdiv(rank, RANK_TILE), SPLIT_BF16=split, WIDEN=x2d.device.type != "cuda",
        BLOCK_M=config.block_m, BLOCK_K=config.block_k, RT=RANK_TILE,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return t


def lora_up_add_triton(base2d: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float, *, offset: int = 0,
                       config: UpConfig | None = None) -> torch.Tensor:
    """``y = round(float(base) + (t[:, offset:offset + rank] @ Bᵀ) * scale)`` into a new tensor, bitwise
    :func:`~.reference.lora_up_add_reference`.

    Args:
        base2d: ``(rows, out_features)`` bfloat16/float16/float32 with unit stride along the last dimension.
        t: ``(rows, rank_total)`` FP32 with unit stride along the last dimension.
        b: ``(out_features, rank)`` FP32, any strides; ``b.stride(0) == 1`` (a view of a contiguous ``Bᵀ``) gives
            coalesced loads.
        scale: effective adapter scale (used as FP32).
        offset: first column of this adapter inside ``t``.
        config: launch configuration (default: :func:`default_up_config` of the rank).

    Returns:
        A new tensor shaped and typed like ``base2d``.

    Raises:
        RuntimeError: triton is not installed.
        ValueError: unsupported dtype, layout or shape.
    """
    _require_triton()
    if base2d.dim() != 2 or t.dim() != 2 or b.dim() != 2:
        raise ValueError("lora_up_add_triton: base, t and B must be 2-D")
    rows, n = base2d.shape
    rank = b.shape[1]
    if t.shape[0] != rows or b.shape[0] != n or offset < 0 or offset + rank > t.shape[1] or rank < 1:
        raise ValueError(
            f"lora_up_add_triton: base {tuple(base2d.shape)}, t {tuple(t.shape)}, B {tuple(b.shape)}, offset {offset} do not match"
        )
    if base2d.dtype not in _OUT_KIND or t.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"lora_up_add_triton: unsupported dtypes base={base2d.dtype}, t={t.dtype}, B={b.dtype}")
    if base2d.stride(1) != 1 or t.stride(1) != 1:
        raise ValueError("lora_up_add_triton: base and t need unit stride along the last dimension")
    out = torch.empty((rows, n), dtype=base2d.dtype, device=base2d.device)
    if rows == 0 or n == 0:
        return out
    config = config or default_up_config(rank)
    grid = (triton.cdiv(rows, config.block_m) * triton.cdiv(n, config.block_n),)
    _lora_up_add_kernel[grid](
        base2d, t[:, offset:], b, out, rows, n, base2d.stride(0), t.stride(0), out.stride(0),
        b.stride(0), b.stride(1), float(scale),
        R=rank, OUT_KIND=_OUT_KIND[base2d.dtype], HW_ROUND=base2d.device.type == "cuda", BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        num_warps=config.num_warps, enable_fp_fusion=False,
    )
    return out


def kernel_configs() -> dict[str, Any]:
    """The default launch configurations (for receipts and benchmark reports)."""
    return {"down": DEFAULT_DOWN_CONFIG.__dict__.copy(), "up_rank_le_8": DEFAULT_UP_CONFIG.__dict__.copy(),
            "up_rank_gt_8": WIDE_RANK_UP_CONFIG.__dict__.copy()}
