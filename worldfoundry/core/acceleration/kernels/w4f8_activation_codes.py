"""The W4F8 activation operand in one launch: FP8 row codes and the appended low-rank codes together.

:func:`~worldfoundry.core.acceleration.kernels.w4f8_scaled_mm.activation_operand` builds
``A = [q_x | a_h | a_t | a_h / 16]`` in two launches: the rowwise quantizer writes ``q_x``, then a second kernel
reads those codes back to form ``a = (q_x @ D̂.T) / α``. At the W81 down projection (``K`` 8,960) the second read
is 293 MB. :func:`quantize_with_appended_codes` does both in one program per ``BLOCK_M`` rows, in two passes over
the row: the row maxima (the activation -- a producer's GELU -- computed and ``1/λ`` applied as the quantizer
does), then per ``BLOCK_K`` columns the codes, stored, and their ``tl.dot`` with the ``D̂`` columns, accumulated in
float32 like the two-launch path.

The codes are rounded onto the e4m3 grid in float32 bit arithmetic (the rounding, ties to even, and saturation
of the hardware cast) before the exact casts to FP8 (stored) and bfloat16 (the dot), so the dot sees exactly the
stored codes. Codes and scales are bitwise those of the rowwise quantizer; the appended codes are those of the
two-launch path up to the order of the float32 dot sums, which follows the tile's rows: at most one e4m3 step
apart, and rarely (tested under the interpreter: 1 of 1,776 in one case, none in the others).

:func:`store_appended_codes` is the epilogue both paths share.
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.core.acceleration.quantization.fp8 import AMAX_FLOOR, FP8_E4M3_MAX

#: (BLOCK_M, BLOCK_K, num_warps) of the one-launch operand (``tl.dot`` needs at least 16 rows).
DEFAULT_TILE: Final = (16, 128, 4)

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import _load_rows, _round_to_e4m3_grid, row_scales
    from worldfoundry.core.acceleration.kernels.w4a8_tiles import _widen

    @triton.jit
    def store_appended_codes(a_ptr, rows64, rmask, stride_a, K, acc, alpha_ptr, RANK: tl.constexpr):
        """``a = acc / α`` (clamped to +-448) written as ``[a_h | a_t | a_h / 16]`` into ``A[rows, K:K + 3r]``.

        Both codes are rounded onto the e4m3 grid in float32 bit arithmetic, so the casts are exact (an
        fp8 -> fp32 read-back of the head gave wrong tails on sm_90)."""
        r = tl.arange(0, RANK)
        a = acc / tl.load(alpha_ptr + r)[None, :]
        a = tl.minimum(tl.maximum(a, -448.0), 448.0)
        head = _round_to_e4m3_grid(a)
        tail = _round_to_e4m3_grid(a - head)
        base = a_ptr + rows64[:, None] * stride_a + K + r[None, :]
        tl.store(base, head.to(tl.float8e4nv), mask=rmask[:, None])
        tl.store(base + RANK, tail.to(tl.float8e4nv), mask=rmask[:, None])
        tl.store(base + 2 * RANK, _round_to_e4m3_grid(head * 0.0625).to(tl.float8e4nv), mask=rmask[:, None])

    @triton.jit
    def _quant_appended_kernel(x_ptr, a_ptr, scale_ptr, d_ptr, alpha_ptr, smooth_ptr, M, K, stride_xm, stride_a,
                               fp8_max, amax_floor, c0, c1, RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_K: tl.constexpr, ACTIVATION: tl.constexpr, PORTABLE_MATH: tl.constexpr,
                               SOFTWARE_ROUNDING: tl.constexpr, HAS_SMOOTH: tl.constexpr, WIDEN: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        x_rows = x_ptr + rows64[:, None] * stride_xm
        a_rows = a_ptr + rows64[:, None] * stride_a
        scale, inv = row_scales(x_rows, row_mask, K, c0, c1, fp8_max, amax_floor, BLOCK_M, BLOCK_K, ACTIVATION,
                                PORTABLE_MATH, SOFTWARE_ROUNDING, smooth_ptr, HAS_SMOOTH)
        r = tl.arange(0, RANK)
        acc = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):  # second read; the activation is recomputed
            v, m, kk = _load_rows(x_rows, row_mask, k_start, K, c0, c1, BLOCK_K, ACTIVATION, PORTABLE_MATH,
                                  SOFTWARE_ROUNDING, smooth_ptr, HAS_SMOOTH)
            y = _round_to_e4m3_grid(tl.minimum(tl.maximum(v * inv[:, None], -fp8_max), fp8_max))
            tl.store(a_rows + kk[None, :], y.to(tl.float8e4nv), mask=m)
            d = tl.load(d_ptr + r[None, :] * K + kk[:, None], mask=(kk < K)[:, None], other=0.0)
            acc = tl.dot(_widen(y.to(tl.bfloat16), WIDEN), _widen(d, WIDEN), acc)
        tl.store(scale_ptr + rows64, scale, mask=row_mask)
        store_appended_codes(a_ptr, rows64, row_mask, stride_a, K, acc, alpha_ptr, RANK)


def quantize_with_appended_codes(x2d: torch.Tensor, down_hat: torch.Tensor, alpha: torch.Tensor,
                                 a_out: torch.Tensor, scale_out: torch.Tensor, *,
                                 inv_smooth: torch.Tensor | None = None, activation: int = 0,
                                 constants: tuple[float, float] = (0.0, 0.0),
                                 tile: tuple[int, int, int] = DEFAULT_TILE) -> None:
    """Fill ``a_out`` (FP8 ``[M, K + 3 r]``) and ``scale_out`` (float32 ``[M, 1]``) in one launch.

    Args:
        x2d: ``[M, K]`` input, unit stride along K (a producer's pre-activation when ``activation`` is set).
        down_hat: bfloat16 ``[r, K]`` (``D * λ``); ``alpha``: float32 ``[r]``.
        inv_smooth: float32 ``[K]`` or ``None`` (an unsmoothed Linear).
        activation, constants: the rowwise quantizer's producer activation (``ACTIVATION_*``) and its constants.
        tile: ``(BLOCK_M, BLOCK_K, num_warps)``; ``BLOCK_M`` at least 16.
    """
    m, k = x2d.shape
    if m == 0:
        return
    block_m, block_k, warps = tile
    interpreted = interpreter_enabled()
    smooth = inv_smooth if inv_smooth is not None else scale_out
    _quant_appended_kernel[(triton.cdiv(m, block_m),)](
        x2d, a_out, scale_out, down_hat, alpha, smooth, m, k, x2d.stride(0), a_out.stride(0), FP8_E4M3_MAX,
        AMAX_FLOOR, float(constants[0]), float(constants[1]), RANK=down_hat.shape[0], BLOCK_M=block_m,
        BLOCK_K=block_k, ACTIVATION=int(activation), PORTABLE_MATH=interpreted, SOFTWARE_ROUNDING=interpreted,
        HAS_SMOOTH=inv_smooth is not None, WIDEN=x2d.device.type != "cuda", num_warps=warps)
