"""Per-token INT8 quantization and the SVDQuant low-rank down projection in one kernel (Triton).

For ``x [M, K]`` (rows contiguous), smoothing ``inv_smooth [K]`` and the low-rank down factor ``D [r, K]``
(bfloat16), one program of ``BLOCK_M`` rows makes two passes over ``BLOCK_K`` chunks:

1. row maximum of ``float32(x) * inv_smooth`` **and** ``t += bf16(x) @ D.T`` (float32 accumulation on tensor
   cores) from the same loaded chunk;
2. the codes ``clamp(round_half_even(x̂ * (127 / a)), -127, 127)`` (the second read mostly from L2).

Rows of up to :data:`SINGLE_PASS_MAX_K` elements can instead be read **once** and kept in registers
(``single_pass``): the row in at most three power-of-two pieces
(:func:`~worldfoundry.core.acceleration.kernels.fp8_rowwise_quant.row_pieces`, ``1536 = 1024 + 512``), the row
maximum and ``t`` from the loaded pieces, the codes from the same registers (the smoothed product recomputed,
bitwise the same). Same bytes and the same ``t`` summation order per piece as the two-pass form up to the
chunking of the float32 dot (tests state the tolerance).

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

from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import row_pieces
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.errors import QuantizationInputError

#: Rows per program, chunk width and warps of the two-pass form on CUDA: the fastest launch shape whose ``t`` was
#: exact and equal across repeats in the H200 grid of ``benchmarks/kernels/int8_lowrank_check.py`` (0.121 ms at
#: K 1,536, 0.483 ms at 8,960). 64 x 128 (4 or 8 warps) is avoided: there, with triton 3.6, ``t`` differed from run
#: to run (up to 66 of a million elements more than 2^-7 of max |t| off) while codes and scales stayed bitwise.
DEFAULT_BLOCK_M: Final = 64
DEFAULT_BLOCK_K: Final = 256
DEFAULT_WARPS: Final = 8
#: The single-pass form keeps ``BLOCK_M x K`` input elements in registers: rows up to this width.
SINGLE_PASS_MAX_K: Final = 2048
#: It stages each piece's ``tl.dot`` operands in shared memory, ``piece * (BLOCK_M + rank) * 2`` bytes (the H200
#: reported exactly that, 384 KB, for a 4,096-wide piece at rank 32): at most this much (an H200's per-block limit).
SINGLE_PASS_SMEM_BYTES: Final = 232448
#: Rows per program of the single-pass form (``tl.dot`` needs at least 16) and its warps.
SINGLE_PASS_BLOCK_M: Final = 16
SINGLE_PASS_WARPS: Final = 4

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from worldfoundry.core.acceleration.kernels.int8_act_quant import _load_piece, _store_codes

    @triton.jit
    def _int8_lowrank_kernel(x_ptr, inv_ptr, d_ptr, q_ptr, s_ptr, t_ptr, M, K, stride_xm, RANK: tl.constexpr,
                             HAS_SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                             WIDEN: tl.constexpr, PERSISTENT: tl.constexpr = False):
        if PERSISTENT:  # fewer programs than row blocks, each walking blocks pid, pid + P, ...
            for blk in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
                _int8_lowrank_block(blk, x_ptr, inv_ptr, d_ptr, q_ptr, s_ptr, t_ptr, M, K, stride_xm, RANK,
                                    HAS_SMOOTH, BLOCK_M, BLOCK_K, WIDEN)
        else:
            _int8_lowrank_block(tl.program_id(0), x_ptr, inv_ptr, d_ptr, q_ptr, s_ptr, t_ptr, M, K, stride_xm, RANK,
                                HAS_SMOOTH, BLOCK_M, BLOCK_K, WIDEN)

    @triton.jit
    def _int8_lowrank_block(pid, x_ptr, inv_ptr, d_ptr, q_ptr, s_ptr, t_ptr, M, K, stride_xm, RANK: tl.constexpr,
                            HAS_SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                            WIDEN: tl.constexpr):
        """Rows ``pid * BLOCK_M ..`` in two passes: row maxima and ``t``, then the codes."""
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


    @triton.jit
    def _raw_piece(x_ptr, row_base, rmask, start, K, P: tl.constexpr):
        """Columns ``start .. start + P`` of the rows as loaded (masked lanes 0), their mask and columns."""
        cols = start + tl.arange(0, P)
        mask = rmask[:, None] & (cols < K)[None, :]
        return tl.load(x_ptr + row_base[:, None] + cols[None, :], mask=mask, other=0.0), mask, cols

    @triton.jit
    def _smoothed(raw, inv_ptr, cols, K, HAS_SMOOTH: tl.constexpr):
        """``float32(raw) * inv_smooth`` (the quantizer's operand; the same product every time it is formed)."""
        xs = raw.to(tl.float32)
        if HAS_SMOOTH:
            xs = xs * tl.load(inv_ptr + cols, mask=cols < K, other=0.0)[None, :]
        return xs

    @triton.jit
    def _piece_dot(raw, d_ptr, cols, K, r, t, WIDEN: tl.constexpr):
        """``t += bf16(raw) @ D[:, cols].T`` (float32 accumulation)."""
        d = tl.load(d_ptr + r[None, :].to(tl.int64) * K + cols[:, None], mask=(cols < K)[:, None], other=0.0)
        xb = raw.to(tl.bfloat16)
        if WIDEN:  # the interpreter multiplies bfloat16 wrongly: widen (exact)
            return tl.dot(xb.to(tl.float32), d.to(tl.float32), t)
        return tl.dot(xb, d, t)

    @triton.jit
    def _int8_lowrank_single_kernel(x_ptr, inv_ptr, d_ptr, q_ptr, s_ptr, t_ptr, M, K, stride_xm,
                                    RANK: tl.constexpr, HAS_SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr,
                                    WIDEN: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        row_base = rows.to(tl.int64) * stride_xm
        out_base = rows.to(tl.int64) * K
        r = tl.arange(0, RANK)
        t = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
        raw0, m0, c0 = _raw_piece(x_ptr, row_base, rmask, 0, K, P0)
        amax = tl.max(tl.abs(_smoothed(raw0, inv_ptr, c0, K, HAS_SMOOTH)), axis=1)
        t = _piece_dot(raw0, d_ptr, c0, K, r, t, WIDEN)
        if P1 > 0:
            raw1, m1, c1 = _raw_piece(x_ptr, row_base, rmask, P0, K, P1)
            amax = tl.maximum(amax, tl.max(tl.abs(_smoothed(raw1, inv_ptr, c1, K, HAS_SMOOTH)), axis=1))
            t = _piece_dot(raw1, d_ptr, c1, K, r, t, WIDEN)
        if P2 > 0:
            raw2, m2, c2 = _raw_piece(x_ptr, row_base, rmask, P0 + P1, K, P2)
            amax = tl.maximum(amax, tl.max(tl.abs(_smoothed(raw2, inv_ptr, c2, K, HAS_SMOOTH)), axis=1))
            t = _piece_dot(raw2, d_ptr, c2, K, r, t, WIDEN)
        amax = tl.maximum(amax, 1e-12)
        rcp = tl.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), amax)
        _store_codes(q_ptr, out_base, _smoothed(raw0, inv_ptr, c0, K, HAS_SMOOTH), rcp, m0, c0)
        if P1 > 0:
            _store_codes(q_ptr, out_base, _smoothed(raw1, inv_ptr, c1, K, HAS_SMOOTH), rcp, m1, c1)
        if P2 > 0:
            _store_codes(q_ptr, out_base, _smoothed(raw2, inv_ptr, c2, K, HAS_SMOOTH), rcp, m2, c2)
        tl.store(s_ptr + rows, tl.div_rn(amax, 127.0), mask=rmask)
        t_ptrs = t_ptr + rows.to(tl.int64)[:, None] * RANK + r[None, :]
        tl.store(t_ptrs, t.to(tl.bfloat16), mask=rmask[:, None])


def check_quant_lowrank_operands(x2d: torch.Tensor, inv_smooth: torch.Tensor | None,
                    lora_down: torch.Tensor) -> tuple[int, int, int]:
    """``(M, K, rank)``, or a typed error naming the operand that does not fit."""
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
    return m, k, rank


def _check_single_pass(k: int, block_m: int, rank: int) -> None:
    if k > SINGLE_PASS_MAX_K or block_m < 16 or block_m & (block_m - 1):
        raise QuantizationInputError(f"quantize_rows_int8_lowrank: the single pass takes rows up to "
                                     f"{SINGLE_PASS_MAX_K} elements and a power-of-two block_m >= 16, got K={k}, "
                                     f"block_m={block_m}")
    smem = row_pieces(k)[0] * (block_m + rank) * 2
    if smem > SINGLE_PASS_SMEM_BYTES:
        raise QuantizationInputError(f"quantize_rows_int8_lowrank: the single pass at K={k}, block_m={block_m}, rank "
                                     f"{rank} needs {smem} bytes of shared memory (limit {SINGLE_PASS_SMEM_BYTES}); "
                                     "use single_pass=False")


def triton_quantize_rows_int8_lowrank(x2d: torch.Tensor, inv_smooth: torch.Tensor | None, lora_down: torch.Tensor,
                                      *, block_m: int | None = None, block_k: int | None = None,
                                      single_pass: bool | None = None, num_warps: int | None = None,
                                      num_stages: int | None = None, programs: int | None = None
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT8 codes, scales and ``t = bf16(x) @ D.T`` of ``x2d`` in one kernel.

    Args:
        x2d: ``[M, K]`` bfloat16/float16/float32 with unit stride along K, on CUDA (or the CPU under
            ``TRITON_INTERPRET=1``).
        inv_smooth: optional float32 ``[K]``.
        lora_down: bfloat16 ``[r, K]`` with ``r`` a power of two >= 16 (rank padded).
        block_m / block_k: rows per program / chunk width (defaults :data:`DEFAULT_BLOCK_M`,
            :data:`DEFAULT_BLOCK_K`; 16 / 64 under the interpreter; single pass: :data:`SINGLE_PASS_BLOCK_M`
            rows, a power of two >= 16, and no chunks).
        single_pass: read each row once (rows up to :data:`SINGLE_PASS_MAX_K`) or in two passes of chunks
            (``False``; the default, ``None``, on CUDA, where it measured faster: 0.17 against 0.22 ms at K 1,536;
            under the interpreter ``None`` takes the single pass where rows fit). Same codes and scales either way.
        num_warps: warps per program (default :data:`DEFAULT_WARPS` on CUDA for the two-pass form,
            :data:`SINGLE_PASS_WARPS` for the single pass).
        num_stages: software-pipelining depth of the two-pass form's chunk loop (default triton's, 3; the
            default launch shape then takes 115,712 bytes of shared memory, two programs per H200 SM; 2 stages:
            66,560 bytes, three programs). Same results.
        programs: the two-pass form with at most this many programs, each walking row blocks ``pid, pid + P, ...``
            (default one program per block). With about one program per SM, the rows a program reads in its
            first pass can still be in the L2 cache for its second (at K 8,960 the default grid keeps more rows in
            flight than the L2 holds). Same results.

    Returns:
        ``(q int8 [M, K], scale float32 [M, 1], t bfloat16 [M, r])``; ``q`` and ``scale`` bitwise the reference
        quantizer's.

    Raises:
        QuantizationInputError: triton missing or operands of the wrong shape/dtype.
    """
    m, k, rank = check_quant_lowrank_operands(x2d, inv_smooth, lora_down)
    q, t = (torch.empty((m, n), dtype=dt, device=x2d.device) for n, dt in ((k, torch.int8), (rank, torch.bfloat16)))
    scale = torch.empty((m, 1), dtype=torch.float32, device=x2d.device)
    if m == 0:
        return q, scale, t
    if single_pass is None:
        single_pass = k <= SINGLE_PASS_MAX_K and interpreter_enabled()
    if single_pass:
        bm = block_m or SINGLE_PASS_BLOCK_M
        _check_single_pass(k, bm, rank)
        p0, p1, p2 = row_pieces(k)
        _int8_lowrank_single_kernel[(triton.cdiv(m, bm),)](
            x2d, inv_smooth if inv_smooth is not None else scale, lora_down, q, scale, t, m, k, x2d.stride(0),
            RANK=rank, HAS_SMOOTH=inv_smooth is not None, BLOCK_M=bm, WIDEN=x2d.device.type != "cuda",
            P0=p0, P1=p1, P2=p2, num_warps=num_warps or SINGLE_PASS_WARPS,
            enable_fp_fusion=False,  # x * rcp must round before the rounding addition (no FMA)
        )
        return q, scale, t
    _launch_two_pass(x2d, inv_smooth, lora_down, (q, scale, t), dict(
        block_m=block_m, block_k=block_k, num_warps=num_warps, num_stages=num_stages, programs=programs))
    return q, scale, t


def _launch_two_pass(x2d: torch.Tensor, inv_smooth: torch.Tensor | None, lora_down: torch.Tensor, outs: tuple,
                     launch: dict) -> None:
    """The two-pass kernel (launch values ``None``: its defaults; the interpreter's are small)."""
    (q, scale, t), (m, k), interp = outs, x2d.shape, interpreter_enabled()
    bm = launch["block_m"] or (16 if interp else DEFAULT_BLOCK_M)
    blocks, programs = triton.cdiv(m, bm), launch["programs"]
    persistent = programs is not None and 0 < programs < blocks
    stages = launch["num_stages"]
    _int8_lowrank_kernel[(programs if persistent else blocks,)](
        x2d, inv_smooth if inv_smooth is not None else scale, lora_down, q, scale, t, m, k, x2d.stride(0),
        RANK=lora_down.shape[0], HAS_SMOOTH=inv_smooth is not None, BLOCK_M=bm,
        BLOCK_K=launch["block_k"] or (64 if interp else DEFAULT_BLOCK_K), WIDEN=x2d.device.type != "cuda",
        PERSISTENT=persistent, num_warps=launch["num_warps"] or (4 if interp else DEFAULT_WARPS),
        **({} if stages is None else {"num_stages": stages}),
        enable_fp_fusion=False,  # x * rcp must round before the rounding addition (no FMA)
    )


__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_M", "DEFAULT_WARPS", "SINGLE_PASS_BLOCK_M", "SINGLE_PASS_MAX_K",
           "SINGLE_PASS_SMEM_BYTES", "SINGLE_PASS_WARPS", "check_quant_lowrank_operands",
           "triton_quantize_rows_int8_lowrank"]
