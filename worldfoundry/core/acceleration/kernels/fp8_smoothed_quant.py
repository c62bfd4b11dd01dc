"""Per-token FP8 quantization of smoothed rows with the smoothing vector held in registers (Triton).

``q, s = quantize_rowwise_fp8(act(x) * inv_smooth)`` -- the activation (none, or GELU as in
:mod:`~worldfoundry.core.acceleration.kernels.fp8_rowwise_quant`: float32, rounded to bfloat16) then one rounded
float32 product with the per-column ``inv_smooth``, the row maximum, ``scale = max / 448`` and ``1 / scale`` as
IEEE divisions, one rounded product per element and round-to-nearest-even onto e4m3. Codes and scales are
**bitwise** the reference's (the same operations as the rowwise kernel, whose launch also takes ``inv_smooth``).

Why a second kernel: the rowwise kernel reads ``inv_smooth`` again for every row it quantizes (36 KB of float32
per 8,960-wide row, from L2), which made smoothing cost 0.28 ms of its 0.62 ms on a W81 ``ffn.2`` input on the
H200. Here each program loads the vector once (a row split into at most three power-of-two pieces, as the
rowwise kernel) and then quantizes ``ROWS`` rows in a loop, one row at a time.

Example (CPU, with ``TRITON_INTERPRET=1`` set before triton is imported)::

    q, scale = triton_quantize_smoothed_fp8(torch.randn(4, 64), torch.rand(64) + 0.5)
"""

from __future__ import annotations

from typing import Any, Final

import torch

from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import (
    ACTIVATION_NONE,
    TRITON_AVAILABLE,
    interpreter_enabled,
    row_pieces,
)
from worldfoundry.core.acceleration.quantization.fp8 import AMAX_FLOOR, FP8_DTYPE, FP8_E4M3_MAX
from worldfoundry.errors import QuantizationInputError

#: Programs per SM of the default launch (each loops over its share of the rows).
PROGRAMS_PER_SM: Final = 4
#: Warps per program of the default launch.
NUM_WARPS: Final = 8

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import _gelu_to_bfloat16, _round_to_e4m3_grid

    @triton.jit
    def _piece(x_row, inv, col0, K, c0, c1, WIDTH: tl.constexpr, ACTIVATION: tl.constexpr,
               PORTABLE_MATH: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, row, M):
        cols = col0 + tl.arange(0, WIDTH)
        mask = (cols < K) & ((tl.zeros([WIDTH], dtype=tl.int32) + row) < M)
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if ACTIVATION != 0:
            v = _gelu_to_bfloat16(v, c0, c1, ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING)
        return v * inv, cols, mask

    @triton.jit
    def _store_piece(q_row, v, rcp, cols, mask, SOFTWARE_ROUNDING: tl.constexpr):
        y = v * rcp
        if SOFTWARE_ROUNDING:
            y = _round_to_e4m3_grid(tl.minimum(tl.maximum(y, -448.0), 448.0))
        tl.store(q_row + cols, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _smoothed_fp8_kernel(x_ptr, inv_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, amax_floor, c0, c1,
                             ROWS: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                             ACTIVATION: tl.constexpr, PORTABLE_MATH: tl.constexpr,
                             SOFTWARE_ROUNDING: tl.constexpr):
        pid = tl.program_id(0)
        c_0 = tl.arange(0, P0)
        inv0 = tl.load(inv_ptr + c_0, mask=c_0 < K, other=0.0)
        if P1 > 0:
            c_1 = P0 + tl.arange(0, P1)
            inv1 = tl.load(inv_ptr + c_1, mask=c_1 < K, other=0.0)
        if P2 > 0:
            c_2 = P0 + P1 + tl.arange(0, P2)
            inv2 = tl.load(inv_ptr + c_2, mask=c_2 < K, other=0.0)
        for i in range(ROWS):
            row = pid * ROWS + i
            x_row = x_ptr + row.to(tl.int64) * stride_xm
            q_row = q_ptr + row.to(tl.int64) * stride_qm
            v0, k0, m0 = _piece(x_row, inv0, 0, K, c0, c1, P0, ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING, row, M)
            amax = tl.max(tl.abs(v0), axis=0)
            if P1 > 0:
                v1, k1, m1 = _piece(x_row, inv1, P0, K, c0, c1, P1, ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING,
                                    row, M)
                amax = tl.maximum(amax, tl.max(tl.abs(v1), axis=0))
            if P2 > 0:
                v2, k2, m2 = _piece(x_row, inv2, P0 + P1, K, c0, c1, P2, ACTIVATION, PORTABLE_MATH,
                                    SOFTWARE_ROUNDING, row, M)
                amax = tl.maximum(amax, tl.max(tl.abs(v2), axis=0))
            scale = tl.div_rn(tl.maximum(amax, amax_floor), 448.0)
            rcp = tl.div_rn(1.0, scale)
            _store_piece(q_row, v0, rcp, k0, m0, SOFTWARE_ROUNDING)
            if P1 > 0:
                _store_piece(q_row, v1, rcp, k1, m1, SOFTWARE_ROUNDING)
            if P2 > 0:
                _store_piece(q_row, v2, rcp, k2, m2, SOFTWARE_ROUNDING)
            one = tl.arange(0, 1)
            tl.store(s_ptr + row + one, tl.zeros([1], dtype=tl.float32) + scale, mask=(row + one) < M)


def _programs(m: int, device: torch.device, programs_per_sm: int) -> int:
    if device.type != "cuda":
        return max(1, min(m, 4))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(m, sms * programs_per_sm))


def triton_quantize_smoothed_fp8(x: torch.Tensor, inv_smooth: torch.Tensor, *, activation: int = ACTIVATION_NONE,
                                 constants: tuple[float, float] = (0.0, 0.0), q_out: torch.Tensor | None = None,
                                 scale_out: torch.Tensor | None = None, programs_per_sm: int = PROGRAMS_PER_SM,
                                 num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``act(x) * inv_smooth``, bitwise the rowwise reference (see the module docstring).

    Args:
        x: ``[M, K]`` float rows with unit column stride, on CUDA (or the CPU under the interpreter).
        inv_smooth: float32 ``[K]`` on the same device.
        activation / constants: as :func:`~worldfoundry.core.acceleration.kernels.fp8_rowwise_quant.launch_rowwise_fp8`.
        q_out / scale_out: optional FP8 ``[M, >= K]`` (unit column stride) and float32 ``[M, 1]`` buffers; the
            codes fill columns ``:K``.
        programs_per_sm / num_warps: launch shape (the result does not depend on it).

    Returns:
        ``(q [M, K] view, scale [M, 1])``.

    Raises:
        QuantizationInputError: triton missing, CPU without the interpreter, or mismatched shapes / dtypes.
    """
    if not TRITON_AVAILABLE or (x.device.type != "cuda" and not interpreter_enabled()):
        raise QuantizationInputError("triton_quantize_smoothed_fp8: needs triton on CUDA (or TRITON_INTERPRET=1)")
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise QuantizationInputError(f"triton_quantize_smoothed_fp8: x must be float [M, K] rows, got "
                                     f"{x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    if inv_smooth.shape != (k,) or inv_smooth.dtype != torch.float32 or inv_smooth.device != x.device:
        raise QuantizationInputError(f"triton_quantize_smoothed_fp8: inv_smooth must be float32 [{k}] on {x.device}")
    q = q_out if q_out is not None else torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = scale_out if scale_out is not None else torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if q.dtype != FP8_DTYPE or q.shape[0] != m or q.shape[1] < k or q.stride(1) != 1 or scale.shape != (m, 1):
        raise QuantizationInputError(f"triton_quantize_smoothed_fp8: q_out must be FP8 [{m}, >= {k}], scale_out [{m}, 1]")
    if m:
        p0, p1, p2 = row_pieces(k)
        programs = _programs(m, x.device, programs_per_sm)
        rows = -(-m // programs)
        programs = -(-m // rows)
        interpreted = interpreter_enabled()
        meta: dict[str, Any] = dict(ROWS=rows, P0=p0, P1=p1, P2=p2, ACTIVATION=int(activation),
                                    PORTABLE_MATH=interpreted, SOFTWARE_ROUNDING=interpreted)
        _smoothed_fp8_kernel[(programs,)](x, inv_smooth, q, scale, m, k, x.stride(0), q.stride(0), AMAX_FLOOR,
                                          float(constants[0]), float(constants[1]), **meta, num_warps=num_warps)
    return q[:, :k], scale


__all__ = ["NUM_WARPS", "PROGRAMS_PER_SM", "triton_quantize_smoothed_fp8"]
