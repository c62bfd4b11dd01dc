"""Per-token INT8 quantization and the SVDQuant low-rank down projection in one kernel (Triton).

For ``x [M, K]`` (rows contiguous), smoothing ``inv_smooth [K]`` and the low-rank down factor ``D [r, K]``
(bfloat16), one program of ``BLOCK_M`` rows makes two passes over ``BLOCK_K`` chunks:

1. row maximum of ``float32(x) * inv_smooth`` **and** ``t += bf16(x) @ D.T`` (float32 accumulation on tensor
   cores) from the same loaded chunk;
2. the codes ``clamp(round_half_even(x̂ * (127 / a)), -127, 127)`` (the second read mostly from L2).

So ``x`` is read from DRAM once for both the quantizer and the low-rank branch, where
:func:`~worldfoundry.core.acceleration.kernels.int8_act_quant.triton_quantize_rows_int8` followed by the separate
low-rank GEMM (:func:`~worldfoundry.core.acceleration.kernels.svdquant_dispatch.lowrank_down`) reads it three
times. Codes and scales are **bitwise** the reference quantizer's (the same float32 operations, shared with
:mod:`.int8_act_quant`, launched without FMA contraction); ``t`` is rounded to bfloat16 from a float32 sum whose
order differs from the bfloat16 GEMM's (tests state the tolerance).
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.errors import QuantizationInputError

#: Rows per program and chunk width on CUDA (the benchmark times 16/32/64 rows).
DEFAULT_BLOCK_M: Final = 32
DEFAULT_BLOCK_K: Final = 256

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from worldfoundry.core.acceleration.kernels.int8_act_quant import _load_piece, _store_codes

    @triton.jit
    def _int8_lowrank_kernel(x_ptr, inv_ptr, d_ptr, q_ptr, s_ptr, t_ptr, M, K, stride_xm, RANK: tl.constexpr,
                             HAS_SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                             WIDEN: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        row_base = rows.to(tl.int64) * stride_xm
        out_base = rows.to(tl.int64) * K
        r = tl.arange(0, RANK)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        t = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < K
            raw = tl.load(x_ptr + row_base[:, None] + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            xs = raw.to(tl.float32)
            if HAS_SMOOTH:
                xs = xs * tl.load(inv_ptr + cols, mask=cmask, other=0.0)[None, :]
            amax = tl.maximum(amax, tl.max(tl.abs(xs), axis=1))
            d = tl.load(d_ptr + r[None, :].to(tl.int64) * K + cols[:, None], mask=cmask[:, None], other=0.0)
            xb = raw.to(tl.bfloat16)
            if WIDEN:  # the interpreter multiplies bfloat16 wrongly: widen (exact)
                t = tl.dot(xb.to(tl.float32), d.to(tl.float32), t)
            else:
                t = tl.dot(xb, d, t)
        amax = tl.maximum(amax, 1e-12)
        rcp = tl.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), amax)
        for k0 in range(0, K, BLOCK_K):
            x, m, c = _load_piece(x_ptr, inv_ptr, row_base, rmask, k0, K, BLOCK_K, HAS_SMOOTH)
            _store_codes(q_ptr, out_base, x, rcp, m, c)
        tl.store(s_ptr + rows, tl.div_rn(amax, 127.0), mask=rmask)
        t_ptrs = t_ptr + rows.to(tl.int64)[:, None] * RANK + r[None, :]
        tl.store(t_ptrs, t.to(tl.bfloat16), mask=rmask[:, None])


def triton_quantize_rows_int8_lowrank(x2d: torch.Tensor, inv_smooth: torch.Tensor | None, lora_down: torch.Tensor,
                                      *, block_m: int | None = None,
                                      block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT8 codes, scales and ``t = bf16(x) @ D.T`` of ``x2d`` in one kernel.

    Args:
        x2d: ``[M, K]`` bfloat16/float16/float32 with unit stride along K, on CUDA (or the CPU under
            ``TRITON_INTERPRET=1``).
        inv_smooth: optional float32 ``[K]``.
        lora_down: bfloat16 ``[r, K]`` with ``r`` a power of two >= 16 (rank padded).
        block_m / block_k: rows per program / chunk width (defaults :data:`DEFAULT_BLOCK_M`,
            :data:`DEFAULT_BLOCK_K`; 16 / 64 under the interpreter).

    Returns:
        ``(q int8 [M, K], scale float32 [M, 1], t bfloat16 [M, r])``; ``q`` and ``scale`` bitwise the reference
        quantizer's.

    Raises:
        QuantizationInputError: triton missing or operands of the wrong shape/dtype.
    """
    if not TRITON_AVAILABLE:
        raise QuantizationInputError("triton is not importable; use the torch reference")
    m, k = x2d.shape
    rank = lora_down.shape[0]
    if x2d.stride(-1) != 1 or lora_down.shape != (rank, k) or lora_down.dtype != torch.bfloat16:
        raise QuantizationInputError(f"quantize_rows_int8_lowrank: x must be [M, {k}] with unit K stride and the "
                                     f"down factor bfloat16 [r, {k}], got {tuple(lora_down.shape)}")
    if rank < 16 or rank & (rank - 1) or not lora_down.is_contiguous():
        raise QuantizationInputError(f"quantize_rows_int8_lowrank: rank {rank} must be a power of two >= 16 "
                                     "(use pad_rank), factor contiguous")
    if inv_smooth is not None and (inv_smooth.shape != (k,) or inv_smooth.dtype != torch.float32):
        raise QuantizationInputError(f"quantize_rows_int8_lowrank: inv_smooth must be float32 [{k}]")
    q = torch.empty((m, k), dtype=torch.int8, device=x2d.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x2d.device)
    t = torch.empty((m, rank), dtype=torch.bfloat16, device=x2d.device)
    if m == 0:
        return q, scale, t
    interp = interpreter_enabled()
    bm = block_m or (16 if interp else DEFAULT_BLOCK_M)
    bk = block_k or (64 if interp else DEFAULT_BLOCK_K)
    _int8_lowrank_kernel[(triton.cdiv(m, bm),)](
        x2d, inv_smooth if inv_smooth is not None else scale, lora_down, q, scale, t, m, k, x2d.stride(0),
        RANK=rank, HAS_SMOOTH=inv_smooth is not None, BLOCK_M=bm, BLOCK_K=bk, WIDEN=x2d.device.type != "cuda",
        num_warps=4 if bm * bk <= 4096 else 8,
        enable_fp_fusion=False,  # x * rcp must round before the rounding addition (no FMA)
    )
    return q, scale, t


__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_M", "triton_quantize_rows_int8_lowrank"]
