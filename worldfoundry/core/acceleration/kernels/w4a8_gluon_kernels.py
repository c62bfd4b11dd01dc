"""Device code of the Hopper int8 ``wgmma`` GEMM in Gluon (Triton's tile-level dialect): W8A8 and W4A8.

One program computes one ``[BLOCK_M tokens, BLOCK_N outputs]`` tile of ``out = s_x[m] * s_w[n] * (q_x[m] . q_w[n])
(+ t @ U.T) (+ b)``:

* **ring**: ``STAGES`` shared-memory slots, each holding one ``[BLOCK_M, BLOCK_K]`` activation tile and one weight
  tile, filled by TMA and signalled by one mbarrier per slot (``expect`` bytes, phase ``(step // STAGES) & 1``);
* **main loop**: ``wgmma`` int8 x int8 -> int32 issued asynchronously, then ``warpgroup_mma_wait(1)``: one MMA
  stays in flight while the program waits for the next slot (and, for INT4, unpacks the next weight tile). After
  the wait, a CTA barrier (every warpgroup has retired MMA ``step - 1``) and the TMA refill of that MMA's slot;
* **INT4 weights** (``INT4``): the slot holds the packed ``[BLOCK_N, BLOCK_K / 2]`` bytes (pairs layout of
  :mod:`worldfoundry.core.acceleration.quantization.int4_packing`: byte ``j`` = codes ``2j`` low, ``2j + 1``
  high). Each thread reads ``PACK_VEC`` bytes along K, makes ``16 * code`` as int8 (``b << 4`` and ``b & 0xF0``),
  interleaves the two nibble tiles into K order (``join`` + ``reshape``: a renaming of registers) and stores the
  ``[BLOCK_N, BLOCK_K]`` int8 tile to one of two NVMMA-swizzled buffers that the next ``wgmma`` reads as its B
  operand (``fence_async_shared`` + CTA barrier first). The factor 16 is folded into the weight scale
  (``W_SCALE_MUL = 1/16``, exact). ``UNPACK`` picks the unpacking: 0 plain int8 ops, 1 inline PTX
  (``shl``/``and`` on four bytes per 32-bit op), 2 inline PTX that also interleaves with ``prmt``;
* **epilogue** in the accumulator's own layout: ``float32(acc) * s_w[n] * s_x[m]`` (this order: the torch
  reference's), the low-rank term ``t @ U.T`` as one bfloat16 ``wgmma`` on tiles TMA-loaded when the program
  starts, bias, bfloat16 store.

Only the CUDA backend compiles Gluon (sm_90 here); the Triton interpreter (``TRITON_INTERPRET=1``) does not run
Gluon kernels, so CPU tests cover the host-side checks only. Importing this module needs no GPU.
"""

from __future__ import annotations

from typing import Final

try:  # triton (optional) with the Gluon dialect and its Hopper module (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    GLUON_AVAILABLE: Final = True
except ImportError:  # pragma: no cover - exercised only where triton or its Gluon dialect is absent
    GLUON_AVAILABLE: Final = False  # type: ignore[misc]

#: ``16 * low nibble`` of four bytes per 32-bit register (PTX).
LOW_NIBBLE_X16_PTX: Final = "{ shl.b32 $0, $1, 4; and.b32 $0, $0, 0xF0F0F0F0; }"
#: ``16 * high nibble`` of four bytes per 32-bit register (PTX).
HIGH_NIBBLE_X16_PTX: Final = "and.b32 $0, $1, 0xF0F0F0F0;"
#: Both nibbles of four packed bytes, interleaved in K order into two registers (``prmt`` byte selects).
INTERLEAVED_X16_PTX: Final = ("{ .reg .b32 lo, hi; shl.b32 lo, $2, 4; and.b32 lo, lo, 0xF0F0F0F0; "
                              "and.b32 hi, $2, 0xF0F0F0F0; prmt.b32 $0, lo, hi, 0x5140; prmt.b32 $1, lo, hi, 0x7362; }")

if GLUON_AVAILABLE:
    # the CTA-wide barrier builtin was renamed after Triton 3.6 (``thread_barrier`` -> ``barrier``)
    _cta_sync = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier")
    _LOW_PTX = gl.constexpr(LOW_NIBBLE_X16_PTX)
    _HIGH_PTX = gl.constexpr(HIGH_NIBBLE_X16_PTX)
    _PAIRS_PTX = gl.constexpr(INTERLEAVED_X16_PTX)

    @gluon.jit
    def _tile_origin(M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """First row and column of this program's tile; ``GROUP_M`` row tiles share a column band (L2 reuse)."""
        pid = gl.program_id(0)
        num_m = gl.cdiv(M, BLOCK_M)
        num_n = gl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = gl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        return pid_m * BLOCK_M, pid_n * BLOCK_N

    @gluon.jit
    def _issue_load(x_desc, w_desc, x_bufs, w_bufs, ready, step, off_m, off_n, STAGES: gl.constexpr):
        """TMA of K step ``step`` (activations and weights) into slot ``step % STAGES``."""
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        W_BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        slot = step % STAGES
        bar = ready.index(slot)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, step * BLOCK_K], bar, x_bufs.index(slot))
        tma.async_copy_global_to_shared(w_desc, [off_n, step * W_BLOCK_K], bar, w_bufs.index(slot))

    @gluon.jit
    def _unpack_x16(p, ROWS: gl.constexpr, HALF_K: gl.constexpr, UNPACK: gl.constexpr):
        """``[ROWS, HALF_K]`` paired bytes -> ``[ROWS, 2 * HALF_K]`` int8 ``16 * code`` in K order."""
        if UNPACK == 2:
            a, b = gl.inline_asm_elementwise(_PAIRS_PTX, "=r,=r,r", [p], dtype=(gl.int8, gl.int8), is_pure=True,
                                             pack=4)
            # a holds K offsets 8i..8i+3 of packed bytes 4i..4i+3, b holds 8i+4..8i+7
            pairs = gl.join(gl.reshape(a, [ROWS, HALF_K // 4, 4]), gl.reshape(b, [ROWS, HALF_K // 4, 4]))
            w = gl.reshape(gl.permute(pairs, (0, 1, 3, 2)), [ROWS, 2 * HALF_K])
        else:
            if UNPACK == 1:
                lo = gl.inline_asm_elementwise(_LOW_PTX, "=r,r", [p], dtype=gl.int8, is_pure=True, pack=4)
                hi = gl.inline_asm_elementwise(_HIGH_PTX, "=r,r", [p], dtype=gl.int8, is_pure=True, pack=4)
            else:
                lo = (p << 4).to(gl.int8)
                hi = (p & -16).to(gl.int8)
            w = gl.reshape(gl.join(lo, hi), [ROWS, 2 * HALF_K])
        return w

    @gluon.jit
    def _stage_int4(packed_smem, w8_smem, ROWS: gl.constexpr, HALF_K: gl.constexpr, UNPACK: gl.constexpr,
                    PACK_VEC: gl.constexpr, NUM_WARPS: gl.constexpr):
        """Unpack one packed weight slot into the int8 ``wgmma`` operand buffer ``w8_smem`` (visible to the MMA)."""
        TPW_K: gl.constexpr = HALF_K // PACK_VEC
        layout: gl.constexpr = gl.BlockedLayout([1, PACK_VEC], [32 // TPW_K, TPW_K], [NUM_WARPS, 1], [1, 0])
        w8_smem.store(_unpack_x16(packed_smem.load(layout), ROWS, HALF_K, UNPACK))
        fence_async_shared()
        _cta_sync()

    @gluon.jit
    def _add_lowrank(out, t_smem, u_smem, lr_bar, WARPS_M: gl.constexpr, WARPS_N: gl.constexpr,
                     INSTR_N: gl.constexpr):
        """``out + t @ U.T``: one bfloat16 ``wgmma`` accumulating onto ``out`` (tiles TMA-loaded at program start)."""
        lr_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
                                                            instr_shape=[16, INSTR_N, 16])
        mbarrier.wait(lr_bar, 0)
        acc = gl.convert_layout(out, lr_layout)  # the same registers: the accumulator layout ignores the MMA's k
        acc = warpgroup_mma(t_smem, u_smem.permute((1, 0)), acc)
        return gl.convert_layout(acc, out.type.layout)

    @gluon.jit
    def _store_tile(out, out_ptr, out_desc, offs_m, offs_n, off_m, off_n, M, N, EPI_TMA: gl.constexpr):
        """bfloat16 tile to ``out``: TMA from a swizzled shared buffer, or plain stores from the MMA layout."""
        if EPI_TMA:
            c_smem = gl.allocate_shared_memory(gl.bfloat16, out.type.shape, out_desc.layout)
            c_smem.store(out.to(gl.bfloat16))
            fence_async_shared()
            _cta_sync()
            tma.async_copy_shared_to_global(out_desc, [off_m, off_n], c_smem)
            tma.store_wait(0)
        else:
            ptrs = out_ptr + gl.expand_dims(offs_m.to(gl.int64) * N, 1) + gl.expand_dims(offs_n, 0)
            mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_n < N, 0)
            gl.store(ptrs, out.to(gl.bfloat16), mask=mask)

    @gluon.jit
    def _epilogue(acc, lr_tiles, xs_ptr, ws_ptr, b_ptr, out_ptr, out_desc, off_m, off_n, M, N,
                  W_SCALE_MUL: gl.constexpr, HAS_LR: gl.constexpr, HAS_BIAS: gl.constexpr, WARPS_M: gl.constexpr,
                  WARPS_N: gl.constexpr, INSTR_N: gl.constexpr, EPI_TMA: gl.constexpr):
        """``float32(acc) * s_w[n] * s_x[m]`` (+ ``t @ U.T``) (+ bias) stored as bfloat16."""
        BLOCK_M: gl.constexpr = acc.type.shape[0]
        BLOCK_N: gl.constexpr = acc.type.shape[1]
        acc_layout: gl.constexpr = acc.type.layout
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        nmask = offs_n < N
        ws = gl.load(ws_ptr + offs_n, mask=nmask, other=0.0).to(gl.float32) * W_SCALE_MUL
        xs = gl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)
        out = acc.to(gl.float32) * gl.expand_dims(ws, 0) * gl.expand_dims(xs, 1)
        if HAS_LR:
            out = _add_lowrank(out, lr_tiles[0], lr_tiles[1], lr_tiles[2], WARPS_M, WARPS_N, INSTR_N)
        if HAS_BIAS:
            out = out + gl.expand_dims(gl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(gl.float32), 0)
        _store_tile(out, out_ptr, out_desc, offs_m, offs_n, off_m, off_n, M, N, EPI_TMA)

    @gluon.jit
    def int8_wgmma_gemm_kernel(x_desc, w_desc, xs_ptr, ws_ptr, t_desc, u_desc, b_ptr, out_ptr, out_desc, M, N, K,
                               W_SCALE_MUL: gl.constexpr, INT4: gl.constexpr, HAS_LR: gl.constexpr,
                               HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                               WARPS_M: gl.constexpr, WARPS_N: gl.constexpr, INSTR_N: gl.constexpr,
                               UNPACK: gl.constexpr, PACK_VEC: gl.constexpr, W8_SWIZZLE: gl.constexpr,
                               EPI_TMA: gl.constexpr, num_warps: gl.constexpr):
        """One output tile: TMA ring, async int8 ``wgmma`` (one in flight), scaled bfloat16 epilogue."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        off_m, off_n = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
                                                             instr_shape=[16, INSTR_N, 32])
        x_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.int8, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        if INT4:
            w8_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=W8_SWIZZLE, element_bitwidth=8, rank=2)
            w8_bufs = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N, BLOCK_K], w8_layout)
        if HAS_LR:
            t_smem = gl.allocate_shared_memory(t_desc.dtype, t_desc.block_type.shape, t_desc.layout)
            u_smem = gl.allocate_shared_memory(u_desc.dtype, u_desc.block_type.shape, u_desc.layout)
            lr_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(lr_bar, count=1)
            mbarrier.expect(lr_bar, t_desc.block_type.nbytes + u_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(t_desc, [off_m, 0], lr_bar, t_smem)
            tma.async_copy_global_to_shared(u_desc, [off_n, 0], lr_bar, u_smem)
        num_k = K // BLOCK_K
        for i in gl.static_range(STAGES - 1):
            if i < num_k:
                _issue_load(x_desc, w_desc, x_bufs, w_bufs, ready, i, off_m, off_n, STAGES)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, acc_layout)
        for step in range(num_k):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            if INT4:
                b = w8_bufs.index(step % 2)
                _stage_int4(w_bufs.index(slot), b, BLOCK_N, BLOCK_K // 2, UNPACK, PACK_VEC, num_warps)
            else:
                b = w_bufs.index(slot)
            acc = warpgroup_mma(x_bufs.index(slot), b.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            _cta_sync()  # every warpgroup has retired MMA step - 1: its slot may be refilled
            if step + STAGES - 1 < num_k:
                _issue_load(x_desc, w_desc, x_bufs, w_bufs, ready, step + STAGES - 1, off_m, off_n, STAGES)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        lr_tiles = (ready, ready, ready)
        if HAS_LR:
            lr_tiles = (t_smem, u_smem, lr_bar)
        _epilogue(acc, lr_tiles, xs_ptr, ws_ptr, b_ptr, out_ptr, out_desc, off_m, off_n, M, N, W_SCALE_MUL, HAS_LR,
                  HAS_BIAS, WARPS_M, WARPS_N, INSTR_N, EPI_TMA)


__all__ = ["GLUON_AVAILABLE", "HIGH_NIBBLE_X16_PTX", "INTERLEAVED_X16_PTX", "LOW_NIBBLE_X16_PTX"]
