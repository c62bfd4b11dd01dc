"""Triton pieces shared by the W4A8 / W4A16 GEMMs: tile order, INT4 unpacking in registers, the W4A8 epilogue.

* :func:`_tile`: grouped program order (``GROUP_M`` row tiles share a column band, for L2 reuse);
* :func:`_low_nibble_x16` / :func:`_high_nibble_x16`: ``16 * code`` of the low / high nibble of a packed byte as
  int8 (``b << 4`` and ``b & 0xF0``), on CUDA with one 32-bit ``shl``/``and`` per four bytes (inline PTX); the
  GEMMs put the 1/16 into the weight scale (exact: a power of two);
* :func:`_w4a8_epilogue`: ``acc * s_x[m]``, the fused low-rank up projection ``tl.dot(t, U.T)`` on the same tile,
  bias, cast and store -- for either tile orientation (``SWAP_AB``: the tile is ``[BLOCK_N, BLOCK_M]``, weights
  as the left operand of every dot).

Under the Triton interpreter (CPU tests) bfloat16 dot operands are widened to float32 first (``WIDEN``; exact),
because the interpreter multiplies bfloat16 wrongly.
"""

from __future__ import annotations

from typing import Any

from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)

    @triton.jit
    def _widen(v, WIDEN: tl.constexpr):
        """bfloat16 -> float32 under the interpreter, whose bfloat16 dot is wrong (exact: bf16 is a subset of f32)."""
        if WIDEN:
            return v.to(tl.float32)
        return v

    @triton.jit
    def _low_nibble(p):
        """Signed low nibble of int8 ``p`` as int8 (explicit casts: shifts may promote to int32)."""
        return ((p << 4).to(tl.int8) >> 4).to(tl.int8)

    @triton.jit
    def _high_nibble(p):
        """Signed high nibble of int8 ``p`` as int8 (arithmetic shift)."""
        return (p >> 4).to(tl.int8)

    @triton.jit
    def _low_nibble_x16(p, ASM: tl.constexpr):
        """``16 * low nibble`` of int8 ``p`` as int8 (``p << 4``); with ``ASM`` four bytes per 32-bit op."""
        if ASM:
            return tl.inline_asm_elementwise("{ shl.b32 $0, $1, 4; and.b32 $0, $0, 0xF0F0F0F0; }", "=r,r", [p],
                                             dtype=tl.int8, is_pure=True, pack=4)
        return (p << 4).to(tl.int8)

    @triton.jit
    def _high_nibble_x16(p, ASM: tl.constexpr):
        """``16 * high nibble`` of int8 ``p`` as int8 (``p & 0xF0``); with ``ASM`` four bytes per 32-bit op."""
        if ASM:
            return tl.inline_asm_elementwise("and.b32 $0, $1, 0xF0F0F0F0;", "=r,r", [p], dtype=tl.int8,
                                             is_pure=True, pack=4)
        return (p & -16).to(tl.int8)

    @triton.jit
    def _w4a8_epilogue(acc, offs_m, offs_n, xs_ptr, t_ptr, lu_ptr, b_ptr, out_ptr, M, N, RANK: tl.constexpr,
                       HAS_LR: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, WIDEN: tl.constexpr,
                       SCALE_ROWS: tl.constexpr = True):
        """``acc * s_x`` (``SCALE_ROWS``; activation scales applied per group in the main loop otherwise) +
        ``t @ U.T`` + bias, stored as the output dtype (``acc``: float32, weight scales applied)."""
        mmask = offs_m < M
        nmask = offs_n < N
        r = tl.arange(0, RANK)
        if SWAP_AB:
            if SCALE_ROWS:
                acc = acc * tl.load(xs_ptr + offs_m, mask=mmask, other=0.0)[None, :]
            if HAS_LR:
                lu = tl.load(lu_ptr + offs_n.to(tl.int64)[:, None] * RANK + r[None, :], mask=nmask[:, None], other=0.0)
                tt = tl.load(t_ptr + offs_m.to(tl.int64)[None, :] * RANK + r[:, None], mask=mmask[None, :], other=0.0)
                acc = tl.dot(_widen(lu, WIDEN), _widen(tt, WIDEN), acc)
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
            ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
            tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])
        else:
            if SCALE_ROWS:
                acc = acc * tl.load(xs_ptr + offs_m, mask=mmask, other=0.0)[:, None]
            if HAS_LR:
                tt = tl.load(t_ptr + offs_m.to(tl.int64)[:, None] * RANK + r[None, :], mask=mmask[:, None], other=0.0)
                lu = tl.load(lu_ptr + offs_n.to(tl.int64)[None, :] * RANK + r[:, None], mask=nmask[None, :], other=0.0)
                acc = tl.dot(_widen(tt, WIDEN), _widen(lu, WIDEN), acc)
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
            ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
            tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def grid_for(m: int, n: int, cfg: dict[str, Any]) -> tuple[int]:
    """Programs of one launch: one per ``BLOCK_M x BLOCK_N`` output tile."""
    return (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)


def split_launch_options(config: dict[str, Any]) -> tuple[dict[str, Any], int, int]:
    """``(meta-parameters, num_warps, num_stages)`` of a config dict (defaults 4 warps, 3 stages)."""
    cfg = dict(config)
    return cfg, int(cfg.pop("num_warps", 4)), int(cfg.pop("num_stages", 3))


__all__ = ["grid_for", "split_launch_options"]
