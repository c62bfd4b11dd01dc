"""The INT8 producer of a down projection fed by a GELU: GELU, smoothing, per-token INT8 and the low-rank down
projection in one kernel (Triton), for ``svdquant``'s ``w4a8`` backend.

In a diffusers ``FeedForward`` the down projection's input is ``g = GELU(h)`` of the up projection's bfloat16
output ``h``. Run per Linear, that costs a GELU kernel (read ``h``, write ``g``), the quantizer (read ``g``, write
codes) and the low-rank GEMM (read ``g`` again). This kernel reads ``h`` and writes only the codes, the row scales
and ``t``. One program of ``BLOCK_M`` rows makes two passes over ``BLOCK_K`` chunks:

1. ``g = bf16(gelu_f32(h))``; the row maximum of ``float32(g) * inv_smooth`` and ``t += g @ D.T`` (float32
   accumulation);
2. ``g`` again (the same instructions, the same bits), the codes ``clamp(round_half_even(ĝ * (127 / a)), ±127)``.

The GELU is the one of :mod:`~worldfoundry.core.acceleration.kernels.fp8_gelu_quant` (the same Triton function):
within ``2**-8 * |gelu(x)| + 2**-20 * |x|`` of the float64 formula, equal to torch's bfloat16 GELU for most but
not all elements. Given that activation, the codes and scales are **bitwise**
:func:`~worldfoundry.core.acceleration.quantization.int8_activation.quantize_rows_int8`'s, and ``t`` is within one
bfloat16 ulp of its largest magnitude of ``bf16(g @ D.T)`` (tests check both on the activation the FP8 producer
returns with ``return_activation=True``). :func:`reference_gelu_quantize_rows_int8_lowrank` is the torch
reference of the function the kernel approximates (torch's GELU, then the reference quantizer).

Example (CPU, with ``TRITON_INTERPRET=1`` set before triton is imported)::

    h = torch.randn(4, 128).to(torch.bfloat16)
    q, scale, t = triton_gelu_quantize_rows_int8_lowrank(h, "tanh", None, torch.zeros(16, 128, dtype=torch.bfloat16))
"""

from __future__ import annotations

from typing import Final

import torch
import torch.nn.functional as F

from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import _KERNEL_ARGS, check_approximate
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import check_quant_lowrank_operands
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8
from worldfoundry.errors import QuantizationInputError

#: Rows per program, chunk width and warps on CUDA: the fastest launch shape at both W81 widths in the H200 grid
#: of ``benchmarks/kernels/int8_lowrank_check.py`` (0.168 ms at K 1,536, 0.776 ms at 8,960; every shape of that
#: grid equal across repeats).
DEFAULT_BLOCK_M: Final = 16
DEFAULT_BLOCK_K: Final = 128
DEFAULT_WARPS: Final = 4

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import _gelu_to_bfloat16
    from worldfoundry.core.acceleration.kernels.int8_act_quant import _store_codes

    @triton.jit
    def _gelu_chunk(h_ptr, inv_ptr, row_base, rmask, start, K, c0, c1, WIDTH: tl.constexpr,
                    HAS_SMOOTH: tl.constexpr, ACTIVATION: tl.constexpr, PORTABLE_MATH: tl.constexpr,
                    SOFTWARE_ROUNDING: tl.constexpr):
        """Columns ``start .. start + WIDTH``: the GELU (float32 on the bfloat16 grid), its smoothed product, the
        mask and the columns (masked lanes are 0: GELU(0) = 0)."""
        cols = start + tl.arange(0, WIDTH)
        cmask = cols < K
        mask = rmask[:, None] & cmask[None, :]
        h = tl.load(h_ptr + row_base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = _gelu_to_bfloat16(h, c0, c1, ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING)
        xs = g
        if HAS_SMOOTH:
            xs = g * tl.load(inv_ptr + cols, mask=cmask, other=0.0)[None, :]
        return g, xs, mask, cols

    @triton.jit
    def _gelu_int8_lowrank_kernel(h_ptr, inv_ptr, d_ptr, q_ptr, s_ptr, t_ptr, M, K, stride_hm, c0, c1,
                                  RANK: tl.constexpr, HAS_SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_K: tl.constexpr, WIDEN: tl.constexpr, ACTIVATION: tl.constexpr,
                                  PORTABLE_MATH: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        row_base = rows.to(tl.int64) * stride_hm
        out_base = rows.to(tl.int64) * K
        r = tl.arange(0, RANK)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        t = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            g, xs, m, cols = _gelu_chunk(h_ptr, inv_ptr, row_base, rmask, k0, K, c0, c1, BLOCK_K, HAS_SMOOTH,
                                         ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING)
            amax = tl.maximum(amax, tl.max(tl.abs(xs), axis=1))
            d = tl.load(d_ptr + r[None, :].to(tl.int64) * K + cols[:, None], mask=(cols < K)[:, None], other=0.0)
            if WIDEN:  # the interpreter multiplies bfloat16 wrongly: widen (exact; g is on the bfloat16 grid)
                t = tl.dot(g, d.to(tl.float32), t)
            else:
                t = tl.dot(g.to(tl.bfloat16), d, t)
        amax = tl.maximum(amax, 1e-12)
        rcp = tl.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), amax)
        for k0 in range(0, K, BLOCK_K):
            g, xs, m, cols = _gelu_chunk(h_ptr, inv_ptr, row_base, rmask, k0, K, c0, c1, BLOCK_K, HAS_SMOOTH,
                                         ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING)
            _store_codes(q_ptr, out_base, xs, rcp, m, cols)
        tl.store(s_ptr + rows, tl.div_rn(amax, 127.0), mask=rmask)
        t_ptrs = t_ptr + rows.to(tl.int64)[:, None] * RANK + r[None, :]
        tl.store(t_ptrs, t.to(tl.bfloat16), mask=rmask[:, None])


def reference_gelu_quantize_rows_int8_lowrank(h: torch.Tensor, approximate: str, inv_smooth: torch.Tensor | None,
                                              lora_down: torch.Tensor | None
                                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Torch reference: ``g = F.gelu(h, approximate)`` (the dense model's activation), the reference quantizer's
    codes and scales of ``g``, and ``t = bf16(g) @ D.T`` (``None`` without a down factor)."""
    g = F.gelu(h, approximate=check_approximate(approximate))
    q, scale = quantize_rows_int8(g, inv_smooth)
    rows = g.reshape(-1, g.shape[-1])
    t = None if lora_down is None else F.linear(rows.to(lora_down.dtype), lora_down)
    return q, scale, t


def triton_gelu_quantize_rows_int8_lowrank(h: torch.Tensor, approximate: str, inv_smooth: torch.Tensor | None,
                                           lora_down: torch.Tensor, *, block_m: int | None = None,
                                           block_k: int | None = None, num_warps: int | None = None,
                                           portable_math: bool | None = None, software_rounding: bool | None = None
                                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GELU + smoothing + per-token INT8 codes and ``t = bf16(GELU(h)) @ D.T`` of ``h`` in one kernel.

    Args:
        h: bfloat16 ``[M, K]`` (the up projection's output), unit stride along K, on CUDA (or the CPU under
            ``TRITON_INTERPRET=1``).
        approximate: ``"tanh"`` or ``"none"``, as ``torch.nn.functional.gelu``.
        inv_smooth: optional float32 ``[K]`` (the down projection's ``1/λ``).
        lora_down: bfloat16 ``[r, K]``, ``r`` a power of two >= 16 (rank padded).
        block_m / block_k / num_warps: launch shape (defaults :data:`DEFAULT_BLOCK_M`, :data:`DEFAULT_BLOCK_K`,
            :data:`DEFAULT_WARPS`; 16 / 64 / 4 under the interpreter).
        portable_math / software_rounding: tanh/erf without libdevice, bfloat16 rounding in bit arithmetic
            (default: only under the interpreter, as the FP8 producer).

    Returns:
        ``(q int8 [M, K], scale float32 [M, 1], t bfloat16 [M, r])``.

    Raises:
        QuantizationInputError: triton missing, ``h`` not bfloat16, operands of the wrong shape, unsupported
            ``approximate``, or a CPU tensor without the interpreter.
    """
    if not isinstance(h, torch.Tensor) or h.dtype != torch.bfloat16 or h.dim() != 2:
        raise QuantizationInputError(f"gelu_quantize_rows_int8_lowrank: h must be bfloat16 [M, K] (the up "
                                     f"projection's output), got {getattr(h, 'dtype', type(h))} "
                                     f"{tuple(getattr(h, 'shape', ()))}")
    activation, (c0, c1) = _KERNEL_ARGS[check_approximate(approximate)]
    m, k, rank = check_quant_lowrank_operands(h, inv_smooth, lora_down)
    interp = interpreter_enabled()
    if h.device.type != "cuda" and not interp:
        raise QuantizationInputError(f"gelu_quantize_rows_int8_lowrank: tensor on {h.device}; the kernel needs a "
                                     "CUDA device (or TRITON_INTERPRET=1 for CPU tests)")
    q = torch.empty((m, k), dtype=torch.int8, device=h.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=h.device)
    t = torch.empty((m, rank), dtype=torch.bfloat16, device=h.device)
    if m == 0:
        return q, scale, t
    bm = block_m or (16 if interp else DEFAULT_BLOCK_M)
    _gelu_int8_lowrank_kernel[(triton.cdiv(m, bm),)](
        h, inv_smooth if inv_smooth is not None else scale, lora_down, q, scale, t, m, k, h.stride(0), c0, c1,
        RANK=rank, HAS_SMOOTH=inv_smooth is not None, BLOCK_M=bm,
        BLOCK_K=block_k or (64 if interp else DEFAULT_BLOCK_K), WIDEN=h.device.type != "cuda",
        ACTIVATION=activation, PORTABLE_MATH=interp if portable_math is None else portable_math,
        SOFTWARE_ROUNDING=interp if software_rounding is None else software_rounding,
        num_warps=num_warps or (4 if interp else DEFAULT_WARPS),
        enable_fp_fusion=False,  # g * rcp must round before the rounding addition (no FMA)
    )
    return q, scale, t


__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_M", "DEFAULT_WARPS", "reference_gelu_quantize_rows_int8_lowrank",
           "triton_gelu_quantize_rows_int8_lowrank"]
