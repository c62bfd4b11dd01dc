"""INT8 activation codes with one scale per token and group of input channels, and the low-rank down projection,
in one read of the input (Triton).

For ``x [M, K]`` (rows contiguous), smoothing ``inv_smooth [K]`` and an optional low-rank down factor ``D [r, K]``
(bfloat16), a program of ``BLOCK_M`` rows walks the row in chunks of ``GROUP`` channels; each chunk is one group,
so its maximum is known from the chunk alone and the codes are written from the registers the chunk was loaded
into: the input is read **once**. Per-token scales need the whole row's maximum before the first code, so
:mod:`.int8_quant_lowrank` reads rows of 8,960 twice (a block of rows does not fit on chip).

Codes and scales are **bitwise**
:func:`~worldfoundry.core.acceleration.quantization.int8_activation.quantize_rows_int8_grouped`'s (the same
float32 operations as :mod:`.int8_act_quant`, per group, launched without FMA contraction); ``t = bf16(x) @ D.T``
is a float32 sum rounded to bfloat16, in another order than the bfloat16 GEMM it replaces (tests state the
tolerance). These are the operands of the W4A8 GEMM with activation scales per group
(:func:`~worldfoundry.core.acceleration.kernels.w4a8_gemm.triton_w4a8_gemm`).

Example (CPU, with ``TRITON_INTERPRET=1`` set before triton is imported)::

    q, scale, t = triton_quantize_rows_int8_grouped_lowrank(x, inv, down, group=128)   # scale [M, K / 128]
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.errors import QuantizationInputError

#: Group widths the kernel takes (one chunk per group: a power of two, and at least ``tl.dot``'s 16).
GROUPS: Final = (32, 64, 128, 256)
#: The transposed scales' row pitch is a multiple of this many tokens (16 bytes: a TMA row pitch).
SCALE_ROW_MULTIPLE: Final = 4
#: Rows per program and warps on CUDA (16 rows under the interpreter): 128 rows for groups up to 128 channels, half
#: that for groups of 256 (the same chunk size). H200, K 8,960, group 128: 0.345 ms per call in a CUDA graph at 128
#: rows and 4 warps against 0.388 ms at 64 rows (``int8_lowrank_check.py --kernels grouped_quant_lowrank``).
DEFAULT_BLOCK_M: Final = 128
DEFAULT_WARPS: Final = 4
#: Channels in one program's chunk at :data:`DEFAULT_BLOCK_M` rows (wider groups get fewer rows).
CHUNK_ELEMENTS: Final = DEFAULT_BLOCK_M * 128


def default_block_m(group: int) -> int:
    """Rows per program on CUDA for groups of ``group`` channels."""
    return min(DEFAULT_BLOCK_M, max(16, CHUNK_ELEMENTS // group))

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from worldfoundry.core.acceleration.kernels.int8_act_quant import _store_codes
    from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import _piece_dot, _raw_piece, _smoothed

    @triton.jit
    def _int8_grouped_lowrank_kernel(x_ptr, inv_ptr, d_ptr, q_ptr, s_ptr, t_ptr, M, K, stride_xm, stride_sm,
                                     stride_sg, RANK: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_LR: tl.constexpr,
                                     BLOCK_M: tl.constexpr, GROUP: tl.constexpr, WIDEN: tl.constexpr):
        """Rows ``pid * BLOCK_M ..``: per group, its maximum, scale and codes, and ``t`` from the same chunk."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        row_base = rows.to(tl.int64) * stride_xm
        out_base = rows.to(tl.int64) * K
        groups = K // GROUP
        s_base = rows.to(tl.int64) * stride_sm
        r = tl.arange(0, RANK)
        t = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
        for g in range(0, groups):
            raw, mask, cols = _raw_piece(x_ptr, row_base, rmask, g * GROUP, K, GROUP)
            xs = _smoothed(raw, inv_ptr, cols, K, HAS_SMOOTH)
            amax = tl.maximum(tl.max(tl.abs(xs), axis=1), 1e-12)
            rcp = tl.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), amax)
            _store_codes(q_ptr, out_base, xs, rcp, mask, cols)
            tl.store(s_ptr + s_base + g * stride_sg, tl.div_rn(amax, 127.0), mask=rmask)
            if HAS_LR:
                t = _piece_dot(raw, d_ptr, cols, K, r, t, WIDEN)
        if HAS_LR:
            t_ptrs = t_ptr + rows.to(tl.int64)[:, None] * RANK + r[None, :]
            tl.store(t_ptrs, t.to(tl.bfloat16), mask=rmask[:, None])


def _check(x2d: torch.Tensor, inv_smooth: torch.Tensor | None, lora_down: torch.Tensor | None,
           group: int) -> tuple[int, int, int]:
    """``(M, K, rank)`` (rank 0 without a down factor), or a typed error naming the operand that does not fit."""
    if not TRITON_AVAILABLE:
        raise QuantizationInputError("triton is not importable; use the torch reference")
    what = "quantize_rows_int8_grouped_lowrank"
    if x2d.dim() != 2 or x2d.stride(-1) != 1 or x2d.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise QuantizationInputError(f"{what}: x must be a float [M, K] with unit K stride, got {x2d.dtype} "
                                     f"{tuple(x2d.shape)}")
    m, k = x2d.shape
    if isinstance(group, bool) or group not in GROUPS or k % group:
        raise QuantizationInputError(f"{what}: group {group!r} must be one of {GROUPS} and divide the {k} input "
                                     "channels")
    if inv_smooth is not None and (inv_smooth.shape != (k,) or inv_smooth.dtype != torch.float32):
        raise QuantizationInputError(f"{what}: inv_smooth must be float32 [{k}]")
    if lora_down is None:
        return m, k, 0
    rank = lora_down.shape[0]
    if lora_down.shape != (rank, k) or lora_down.dtype != torch.bfloat16 or not lora_down.is_contiguous():
        raise QuantizationInputError(f"{what}: the down factor must be a contiguous bfloat16 [r, {k}], got "
                                     f"{lora_down.dtype} {tuple(lora_down.shape)}")
    if rank < 16 or rank & (rank - 1):
        raise QuantizationInputError(f"{what}: rank {rank} must be a power of two >= 16 (use pad_rank)")
    return m, k, rank


def triton_quantize_rows_int8_grouped_lowrank(x2d: torch.Tensor, inv_smooth: torch.Tensor | None,
                                              lora_down: torch.Tensor | None, group: int, *,
                                              block_m: int | None = None, num_warps: int | None = None,
                                              transposed_scales: bool = False
                                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """INT8 codes and scales per token and group of ``group`` channels, and ``t = bf16(x) @ D.T``, in one read.

    Args:
        x2d: ``[M, K]`` bfloat16/float16/float32 with unit stride along K, on CUDA (or the CPU under
            ``TRITON_INTERPRET=1``).
        inv_smooth: optional float32 ``[K]``.
        lora_down: bfloat16 ``[r, K]`` with ``r`` a power of two >= 16 (rank padded), or ``None`` (no ``t``).
        group: channels per activation scale, one of :data:`GROUPS`, dividing ``K``.
        block_m: rows per program, a power of two >= 16 (default :func:`default_block_m`; 16 under the
            interpreter).
        num_warps: warps per program (default :data:`DEFAULT_WARPS`).
        transposed_scales: write the scales group-major, into a ``[K / group, P]`` buffer whose row pitch ``P`` is
            ``M`` rounded up to :data:`SCALE_ROW_MULTIPLE` (what the Gluon grouped GEMM reads in place);
            ``scale`` is then the ``[M, K / group]`` view of it with strides ``(1, P)``.

    Returns:
        ``(q int8 [M, K], scale float32 [M, K / group], t bfloat16 [M, r] or None)``; ``q`` and ``scale``
        bitwise the reference's.

    Raises:
        QuantizationInputError: triton missing, or an operand or launch value that does not fit.
    """
    m, k, rank = _check(x2d, inv_smooth, lora_down, group)
    bm = block_m or (16 if interpreter_enabled() else default_block_m(group))
    if bm < 16 or bm & (bm - 1):
        raise QuantizationInputError(f"quantize_rows_int8_grouped_lowrank: block_m {bm} must be a power of two "
                                     ">= 16")
    q = torch.empty((m, k), dtype=torch.int8, device=x2d.device)
    if transposed_scales:
        pitch = -(-max(m, 1) // SCALE_ROW_MULTIPLE) * SCALE_ROW_MULTIPLE
        scale = torch.empty((k // group, pitch), dtype=torch.float32, device=x2d.device)[:, :m].t()
    else:
        scale = torch.empty((m, k // group), dtype=torch.float32, device=x2d.device)
    t = torch.empty((m, rank), dtype=torch.bfloat16, device=x2d.device) if rank else None
    if m == 0:
        return q, scale, t
    _int8_grouped_lowrank_kernel[(triton.cdiv(m, bm),)](
        x2d, inv_smooth if inv_smooth is not None else scale, lora_down if rank else x2d, q, scale,
        t if rank else q, m, k, x2d.stride(0), scale.stride(0), scale.stride(1), RANK=rank or 16,
        HAS_SMOOTH=inv_smooth is not None, HAS_LR=bool(rank), BLOCK_M=bm, GROUP=group, WIDEN=x2d.device.type != "cuda",
        num_warps=num_warps or DEFAULT_WARPS,
        enable_fp_fusion=False,  # x * rcp must round before the rounding addition (no FMA)
    )
    return q, scale, t


__all__ = ["DEFAULT_BLOCK_M", "DEFAULT_WARPS", "GROUPS", "SCALE_ROW_MULTIPLE", "default_block_m",
           "triton_quantize_rows_int8_grouped_lowrank"]
