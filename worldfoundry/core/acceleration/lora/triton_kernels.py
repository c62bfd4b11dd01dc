"""Triton kernels of the FP32 LoRA adapter arithmetic (the torch reference is :mod:`.reference`).

Two kernels, both reading their large operand once:

* ``lora_down`` — ``t = x @ Aᵀ`` for up to :data:`KERNEL_MAX_RANK` stacked adapter rows. The activations are
  read once in their own dtype and accumulated in FP32. For bfloat16 activations the FP32 ``A`` is given as
  three bfloat16 terms (:func:`~.reference.split_bf16x3`) and multiplied on the tensor cores: every product
  of two bfloat16 values is exact in FP32 and the accumulator is FP32, so the result is FP32 arithmetic
  without an FP32 copy of the activations. Other activation dtypes use IEEE FP32 dot products.
* ``lora_up_add`` — ``y = round(float(base) + scale * t[:, offset:offset + rank] @ Bᵀ)`` with FP32 FMAs over the
  rank (no padding of small ranks), reading the base output once and writing ``y`` once. The final rounding to
  bfloat16 is done with integer operations (round to nearest even), so the interpreter and the GPU produce
  the same bits from the same FP32 sum.

CPU tensors run through Triton's interpreter (``TRITON_INTERPRET=1``, for tests): there the bfloat16 operands of
the dot product are widened to FP32 first (exact) because the interpreter cannot multiply bfloat16 directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch

try:  # Triton is optional: without it the dispatcher always uses the torch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

HAS_TRITON: Final = triton is not None
#: Largest stacked rank the down kernel handles in one pass (the accumulator tile is BLOCK_M × 128 FP32).
KERNEL_MAX_RANK: Final = 128
#: Activation/output dtypes the kernels accept.
KERNEL_DTYPES: Final = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class DownConfig:
    """Launch configuration of the down kernel."""

    block_m: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class UpConfig:
    """Launch configuration of the up-and-add kernel."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_DOWN_CONFIG: Final = DownConfig()
DEFAULT_UP_CONFIG: Final = UpConfig()


if HAS_TRITON:

    @triton.jit
    def _lora_down_kernel(x_ptr, a_ptr, t_ptr, M, K, stride_xm, stride_tm,
                          R: tl.constexpr, SPLIT_BF16: tl.constexpr, WIDEN: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
        pid = tl.program_id(0)
        rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rr = tl.arange(0, BLOCK_R)
        row_ok = rm < M
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a_mask = k_ok[:, None] & (rr[None, :] < R)
            a_offsets = rr[None, :] * K + rk[:, None]  # A is (R, K) row-major; the tile is read transposed
            if SPLIT_BF16:
                for s in tl.static_range(3):
                    a = tl.load(a_ptr + s * R * K + a_offsets, mask=a_mask, other=0.0)
                    if WIDEN:
                        acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(x, a, acc)
            else:
                a = tl.load(a_ptr + a_offsets, mask=a_mask, other=0.0)
                acc = tl.dot(x.to(tl.float32), a, acc, input_precision="ieee")
        tl.store(t_ptr + rm[:, None].to(tl.int64) * stride_tm + rr[None, :], acc,
                 mask=row_ok[:, None] & (rr[None, :] < R))

    @triton.jit
    def _round_fp32_to_bf16(y):
        # Round to nearest even on the bit pattern; NaN stays a quiet NaN.
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _lora_up_add_kernel(base_ptr, t_ptr, b_ptr, out_ptr, M, N, stride_basem, stride_tm, t_offset,
                            stride_outm, stride_bn, scale,
                            R: tl.constexpr, OUT_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rm < M
        col_ok = rn < N
        rm64 = rm.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(R):
            tc = tl.load(t_ptr + rm64 * stride_tm + t_offset + j, mask=row_ok, other=0.0)
            bc = tl.load(b_ptr + rn * stride_bn + j, mask=col_ok, other=0.0)
            acc += tc[:, None] * bc[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        base = tl.load(base_ptr + rm64[:, None] * stride_basem + rn[None, :], mask=mask, other=0.0)
        y = base.to(tl.float32) + scale * acc
        if OUT_KIND == 0:  # bfloat16
            out = _round_fp32_to_bf16(y)
        elif OUT_KIND == 1:  # float16
            out = y.to(tl.float16)
        else:  # float32
            out = y
        tl.store(out_ptr + rm64[:, None] * stride_outm + rn[None, :], out, mask=mask)


_OUT_KIND: Final = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the torch reference (worldfoundry.core.acceleration.lora.reference)")


def lora_down_triton(x2d: torch.Tensor, a: torch.Tensor, a_bf16x3: torch.Tensor | None = None, *,
                     config: DownConfig = DEFAULT_DOWN_CONFIG) -> torch.Tensor:
    """``t = x @ Aᵀ`` accumulated in FP32, reading ``x`` once.

    Args:
        x2d: ``(rows, in_features)`` bfloat16/float16/float32 with unit stride along the last dimension.
        a: ``(rank_total, in_features)`` FP32, contiguous, ``rank_total <= KERNEL_MAX_RANK``.
        a_bf16x3: ``split_bf16x3(a)``; when given and ``x2d`` is bfloat16 the tensor-core path is used.
        config: launch configuration.

    Returns:
        ``(rows, rank_total)`` FP32.

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
    if split and (a_bf16x3.shape != (3, *a.shape) or a_bf16x3.dtype != torch.bfloat16 or not a_bf16x3.is_contiguous()):
        raise ValueError("lora_down_triton: a_bf16x3 must be split_bf16x3(A)")
    rows, k = x2d.shape
    t = torch.empty((rows, rank), dtype=torch.float32, device=x2d.device)
    if rows == 0:
        return t
    grid = (triton.cdiv(rows, config.block_m),)
    _lora_down_kernel[grid](
        x2d, a_bf16x3 if split else a, t, rows, k, x2d.stride(0), t.stride(0),
        R=rank, SPLIT_BF16=split, WIDEN=x2d.device.type != "cuda",
        BLOCK_M=config.block_m, BLOCK_K=config.block_k, BLOCK_R=max(16, _next_power_of_two(rank)),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return t


def lora_up_add_triton(base2d: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float, *, offset: int = 0,
                       config: UpConfig = DEFAULT_UP_CONFIG) -> torch.Tensor:
    """``y = round(float(base) + scale * t[:, offset:offset + rank] @ Bᵀ)`` into a new tensor.

    Args:
        base2d: ``(rows, out_features)`` bfloat16/float16/float32 with unit stride along the last dimension.
        t: ``(rows, rank_total)`` FP32 with unit stride along the last dimension.
        b: ``(out_features, rank)`` FP32, contiguous.
        scale: effective adapter scale.
        offset: first column of this adapter inside ``t``.
        config: launch configuration.

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
    if t.shape[0] != rows or b.shape[0] != n or offset < 0 or offset + rank > t.shape[1]:
        raise ValueError(
            f"lora_up_add_triton: base {tuple(base2d.shape)}, t {tuple(t.shape)}, B {tuple(b.shape)}, offset {offset} do not match"
        )
    if base2d.dtype not in _OUT_KIND or t.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"lora_up_add_triton: unsupported dtypes base={base2d.dtype}, t={t.dtype}, B={b.dtype}")
    if base2d.stride(1) != 1 or t.stride(1) != 1 or not b.is_contiguous():
        raise ValueError("lora_up_add_triton: base and t need unit stride along the last dimension, B contiguous")
    out = torch.empty((rows, n), dtype=base2d.dtype, device=base2d.device)
    if rows == 0 or n == 0:
        return out
    grid = (triton.cdiv(rows, config.block_m), triton.cdiv(n, config.block_n))
    _lora_up_add_kernel[grid](
        base2d, t, b, out, rows, n, base2d.stride(0), t.stride(0), offset, out.stride(0), b.stride(0), float(scale),
        R=rank, OUT_KIND=_OUT_KIND[base2d.dtype], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def kernel_configs() -> dict[str, Any]:
    """The default launch configurations (for receipts and benchmark reports)."""
    return {"down": DEFAULT_DOWN_CONFIG.__dict__.copy(), "up": DEFAULT_UP_CONFIG.__dict__.copy()}
