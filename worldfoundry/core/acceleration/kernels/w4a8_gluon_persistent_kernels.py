"""Device code of the persistent, warp-specialised W4A8 GEMM for Hopper in Gluon (INT4 weights as the register operand).

The program count is the SM count; each program walks output tiles ``tile = pid, pid + P, pid + 2P, ...`` in a
grouped order. The GEMM is computed transposed: a tile is ``[BLOCK_W outputs, BLOCK_T tokens]`` of ``out.T``, so the
INT4 weights are the ``A`` operand of ``wgmma`` and enter **from registers**; the unpacked int8 weights never touch
shared memory (the non-persistent kernel of :mod:`.w4a8_gluon_kernels` writes and re-reads them there, which makes
it shared-memory bound). Two partitions share a ring of ``STAGES`` slots (activation tile ``[BLOCK_T, BLOCK_K]``
int8 and packed weight tile ``[BLOCK_W, BLOCK_K / 2]``), with a ``ready`` and an ``empty`` mbarrier per slot:

* **loader** (one warp): TMA of each K step into the next free slot; with the low-rank term, ``LR_STEPS`` more
  slots per tile receive column chunks of ``t[tokens, :r]`` and ``U[outputs, :r]`` (bfloat16, reinterpreting the
  slot's two buffers), so no shared memory stays reserved for them during the main loop;
* **consumer** (the kernel's ``num_warps`` warps, one or two warpgroups): per K step, packed bytes are read in the
  16-bit ``wgmma`` operand layout (thread ``l`` holds bytes ``2c, 2c + 1`` for ``c = l % 4``: the four K positions
  ``4c .. 4c + 3`` of the int8 operand layout), split into ``16 * code`` nibbles and joined in K order (register
  renaming only), then ``wgmma`` int8 x int8 -> int32 with ``A`` in registers, issued asynchronously: one MMA stays in
  flight while the next slot is unpacked (into other registers: the loop body holds two K steps, since ``ptxas``
  does not keep an in-flight MMA's register operand from being overwritten), and a slot is released (``empty``
  arrive) once its MMA has retired;
* **epilogue** (consumer, per tile): ``float32(acc) * s_w[n] * s_x[m]`` (the reference's order), the low-rank
  term as a bfloat16 ``wgmma`` accumulating onto it (``U`` is ``A``, ``t`` is ``B``), bias, bfloat16, stored through
  a transposed view of a shared tile with a TMA store that is left in flight: it is waited for only before the
  shared tile is written again, one tile later, so the store overlaps the next tile's main loop;
* **row maximum** (``ROW_MAX``, optional): the tile's largest bfloat16 output per token, floored at 0, is merged
  into ``row_max[token]`` with an atomic maximum on the float's bits (non-negative floats order as their int32
  bits, and a maximum does not depend on the order the tiles arrive in: the result is deterministic). ``ROW_MAX``
  1 reduces the accumulator across lanes and warps before the store; 2 reads the bfloat16 tile staged for the
  store back, one token row per thread, while the TMA store is in flight. A GELU
  producer that quantizes this output per token then knows each row's scale before reading the row, and reads it
  once (:mod:`.int8_gelu_quant`).

Numerics equal :mod:`.w4a8_gluon_kernels` (int32 sum exact, scaling in the reference's order). Gluon compiles for
CUDA only; the Triton interpreter does not run it. Importing this module needs no GPU.
"""

from __future__ import annotations

from typing import Final

from worldfoundry.core.acceleration.kernels.w4a8_gluon_kernels import (
    GLUON_AVAILABLE,
    HIGH_NIBBLE_X16_PTX,
    LOW_NIBBLE_X16_PTX,
)

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _cta_sync = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier")
    _LOW_PTX = gl.constexpr(LOW_NIBBLE_X16_PTX)
    _HIGH_PTX = gl.constexpr(HIGH_NIBBLE_X16_PTX)

    @gluon.jit
    def _tile_offsets(tile, num_t, num_w, BLOCK_T: gl.constexpr, BLOCK_W: gl.constexpr, GROUP_T: gl.constexpr):
        """First token and first output of tile ``tile``; ``GROUP_T`` token bands share an output band."""
        width = GROUP_T * num_w
        first_t = (tile // width) * GROUP_T
        size_t = gl.minimum(num_t - first_t, GROUP_T)
        pid_t = first_t + (tile % width) % size_t
        pid_w = (tile % width) // size_t
        return pid_t * BLOCK_T, pid_w * BLOCK_W

    @gluon.jit
    def _load_slot(desc_a, desc_b, x_bufs, w_bufs, ready, empty, it, coord_a, coord_b, STAGES: gl.constexpr):
        """Wait until ring slot ``it`` is free, then TMA one ``desc_a`` box to its activation buffer and one
        ``desc_b`` box to its weight buffer (reinterpreted when the boxes are the low-rank bfloat16 tiles)."""
        slot = it % STAGES
        mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes)
        a_view = x_bufs.index(slot)._reinterpret(desc_a.dtype, desc_a.block_type.shape, desc_a.layout)
        b_view = w_bufs.index(slot)._reinterpret(desc_b.dtype, desc_b.block_type.shape, desc_b.layout)
        tma.async_copy_global_to_shared(desc_a, coord_a, bar, a_view)
        tma.async_copy_global_to_shared(desc_b, coord_b, bar, b_view)
        return it + 1

    @gluon.jit
    def _loader_partition(x_desc, w_desc, t_desc, u_desc, x_bufs, w_bufs, ready, empty, M, N, K,
                          GROUP_T: gl.constexpr, STAGES: gl.constexpr, LR_STEPS: gl.constexpr):
        """TMA producer: every K step of every tile of this program, then its ``LR_STEPS`` low-rank slots."""
        BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_W: gl.constexpr = w_desc.block_type.shape[0]
        W_BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        num_t = gl.cdiv(M, BLOCK_T)
        num_w = gl.cdiv(N, BLOCK_W)
        num_k = K // BLOCK_K
        it = 0
        for tile in range(gl.program_id(0), num_t * num_w, gl.num_programs(0)):
            off_t, off_w = _tile_offsets(tile, num_t, num_w, BLOCK_T, BLOCK_W, GROUP_T)
            for k in range(num_k):
                it = _load_slot(x_desc, w_desc, x_bufs, w_bufs, ready, empty, it, [off_t, k * BLOCK_K],
                                [off_w, k * W_BLOCK_K], STAGES)
            for c in gl.static_range(LR_STEPS):
                chunk = c * t_desc.block_type.shape[1]
                it = _load_slot(t_desc, u_desc, x_bufs, w_bufs, ready, empty, it, [off_t, chunk], [off_w, chunk],
                                STAGES)

    @gluon.jit
    def _weight_operand(packed_smem, acc_layout: gl.constexpr, UNPACK: gl.constexpr):
        """Packed ``[BLOCK_W, BLOCK_K / 2]`` slot -> int8 ``16 * code`` ``[BLOCK_W, BLOCK_K]``, A-operand layout."""
        ROWS: gl.constexpr = packed_smem.type.shape[0]
        HALF_K: gl.constexpr = packed_smem.type.shape[1]
        packed_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
        p = packed_smem.load(packed_layout)
        if UNPACK == 1:
            lo = gl.inline_asm_elementwise(_LOW_PTX, "=r,r", [p], dtype=gl.int8, is_pure=True, pack=4)
            hi = gl.inline_asm_elementwise(_HIGH_PTX, "=r,r", [p], dtype=gl.int8, is_pure=True, pack=4)
        else:
            lo = (p << 4).to(gl.int8)
            hi = (p & -16).to(gl.int8)
        w = gl.reshape(gl.join(lo, hi), [ROWS, 2 * HALF_K])
        return gl.convert_layout(w, a_layout)

    @gluon.jit
    def _release(empty, slot):
        """Every consumer warp has retired the MMA that read ``slot``: hand the slot back to the loader."""
        _cta_sync()
        mbarrier.arrive(empty.index(slot), count=1)

    @gluon.jit
    def _k_step(x_bufs, w_bufs, ready, empty, acc, it, acc_layout: gl.constexpr, STAGES: gl.constexpr,
                UNPACK: gl.constexpr):
        """K step ``it``: unpack its weights while MMA ``it - 1`` runs, issue MMA ``it``, retire ``it - 1``."""
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        a = _weight_operand(w_bufs.index(slot), acc_layout, UNPACK)
        acc = warpgroup_mma(a, x_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        _release(empty, (it + STAGES - 1) % STAGES)
        return acc

    @gluon.jit
    def _main_loop(x_bufs, w_bufs, ready, empty, it, num_k, acc_layout: gl.constexpr, STAGES: gl.constexpr,
                   UNPACK: gl.constexpr):
        """int32 ``acc = W8 @ X.T`` of one tile over ``num_k`` ring slots starting at counter ``it``.

        The register operand of an MMA in flight must not be overwritten, so consecutive K steps must not share
        registers: the loop body holds two steps (two distinct operand values), the odd step left over runs after.
        """
        BLOCK_T: gl.constexpr = x_bufs.type.shape[1]
        BLOCK_W: gl.constexpr = w_bufs.type.shape[1]
        acc = gl.zeros([BLOCK_W, BLOCK_T], gl.int32, acc_layout)
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        a = _weight_operand(w_bufs.index(slot), acc_layout, UNPACK)
        acc = warpgroup_mma(a, x_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))  # nothing to wait for yet: the loop carries a plain tensor
        for j in range((num_k - 1) // 2):
            acc = _k_step(x_bufs, w_bufs, ready, empty, acc, it + 1 + 2 * j, acc_layout, STAGES, UNPACK)
            acc = _k_step(x_bufs, w_bufs, ready, empty, acc, it + 2 + 2 * j, acc_layout, STAGES, UNPACK)
        if (num_k - 1) % 2 == 1:
            acc = _k_step(x_bufs, w_bufs, ready, empty, acc, it + num_k - 1, acc_layout, STAGES, UNPACK)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        _release(empty, (it + num_k - 1) % STAGES)
        return acc, it + num_k

    @gluon.jit
    def _add_lowrank(out, x_bufs, w_bufs, ready, empty, it, t_desc, u_desc, STAGES: gl.constexpr,
                     LR_STEPS: gl.constexpr):
        """``out + U @ t.T`` from ``LR_STEPS`` low-rank slots (bfloat16 ``wgmma`` accumulating in float32)."""
        parent: gl.constexpr = out.type.layout
        lr_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=parent.warps_per_cta,
                                                            instr_shape=[16, parent.instr_shape[1], 16])
        acc = gl.convert_layout(out, lr_layout)  # the same registers: the accumulator layout ignores the MMA's k
        for c in gl.static_range(LR_STEPS):
            slot = (it + c) % STAGES
            mbarrier.wait(ready.index(slot), ((it + c) // STAGES) & 1)
            t_view = x_bufs.index(slot)._reinterpret(t_desc.dtype, t_desc.block_type.shape, t_desc.layout)
            u_view = w_bufs.index(slot)._reinterpret(u_desc.dtype, u_desc.block_type.shape, u_desc.layout)
            acc = warpgroup_mma(u_view, t_view.permute((1, 0)), acc)
            _release(empty, slot)
        return gl.convert_layout(acc, parent), it + LR_STEPS

    @gluon.jit
    def _store_transposed(out, c_smem, out_desc, off_t, off_w):
        """bfloat16 ``out.T`` to ``[off_t, off_w]`` by TMA, once the previous tile's store has read ``c_smem``."""
        tma.store_wait(0)
        _cta_sync()
        c_smem.permute((1, 0)).store(out.to(gl.bfloat16))
        fence_async_shared()
        _cta_sync()
        tma.async_copy_shared_to_global(out_desc, [off_t, off_w], c_smem)

    @gluon.jit
    def _merge_row_max(out, rm_ptr, off_t, M):
        """``row_max[t] = max(row_max[t], max_w bf16(out[w, t]), 0)`` for the tile's tokens (int32 bits of
        non-negative floats: an order-independent atomic maximum)."""
        BLOCK_T: gl.constexpr = out.type.shape[1]
        NUM_WARPS: gl.constexpr = gl.num_warps()
        # one token per thread before the atomics: in the accumulator's slice every value sits in many threads
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        tmax = gl.maximum(gl.max(out.to(gl.bfloat16).to(gl.float32), axis=0), 0.0)
        tmax = gl.convert_layout(tmax, flat)
        offs = off_t + gl.arange(0, BLOCK_T, layout=flat)
        gl.atomic_max(rm_ptr + offs, tmax.to(gl.int32, bitcast=True), mask=offs < M, sem="relaxed")

    @gluon.jit
    def _merge_row_max_staged(c_smem, rm_ptr, off_t, M):
        """:func:`_merge_row_max` from the bfloat16 tile staged for the TMA store (``[tokens, outputs]``), read one
        token row per thread while the store is in flight: no cross-lane or cross-warp reduction."""
        BLOCK_T: gl.constexpr = c_smem.type.shape[0]
        BLOCK_W: gl.constexpr = c_smem.type.shape[1]
        NUM_WARPS: gl.constexpr = gl.num_warps()
        rows: gl.constexpr = gl.BlockedLayout([1, BLOCK_W], [32, 1], [NUM_WARPS, 1], [1, 0])
        tmax = gl.maximum(gl.max(c_smem.load(rows).to(gl.float32), axis=1), 0.0)
        offs = off_t + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, rows))
        gl.atomic_max(rm_ptr + offs, tmax.to(gl.int32, bitcast=True), mask=offs < M, sem="relaxed")

    @gluon.jit
    def _consumer_partition(x_bufs, w_bufs, ready, empty, c_smem, out_desc, t_desc, u_desc, xs_ptr, ws_ptr, b_ptr,
                            rm_ptr, M, N, K, W_SCALE_MUL: gl.constexpr, LR_STEPS: gl.constexpr,
                            HAS_BIAS: gl.constexpr, GROUP_T: gl.constexpr, STAGES: gl.constexpr,
                            INSTR_N: gl.constexpr, UNPACK: gl.constexpr, ROW_MAX: gl.constexpr,
                            NUM_WARPS: gl.constexpr):
        """MMA warpgroups: main loop, scaled epilogue with the low-rank term and bias, asynchronous TMA store."""
        BLOCK_T: gl.constexpr = x_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = x_bufs.type.shape[2]
        BLOCK_W: gl.constexpr = w_bufs.type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, INSTR_N, 32])
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        num_t = gl.cdiv(M, BLOCK_T)
        num_w = gl.cdiv(N, BLOCK_W)
        num_k = K // BLOCK_K
        it = 0
        for tile in range(gl.program_id(0), num_t * num_w, gl.num_programs(0)):
            off_t, off_w = _tile_offsets(tile, num_t, num_w, BLOCK_T, BLOCK_W, GROUP_T)
            offs_w = off_w + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, acc_layout))
            wmask = offs_w < N
            # scales (and bias) are loaded before the main loop, which hides their latency
            ws = gl.load(ws_ptr + offs_w, mask=wmask, other=0.0).to(gl.float32) * W_SCALE_MUL
            offs_tp = off_t + gl.arange(0, BLOCK_T, layout=flat)  # compact: one register, not one per acc column
            xs = gl.load(xs_ptr + offs_tp, mask=offs_tp < M, other=0.0)
            if HAS_BIAS:
                bias = gl.load(b_ptr + offs_w, mask=wmask, other=0.0).to(gl.float32)
            acc, it = _main_loop(x_bufs, w_bufs, ready, empty, it, num_k, acc_layout, STAGES, UNPACK)
            xs = gl.convert_layout(xs, gl.SliceLayout(0, acc_layout))
            out = acc.to(gl.float32) * gl.expand_dims(ws, 1) * gl.expand_dims(xs, 0)
            if LR_STEPS > 0:
                out, it = _add_lowrank(out, x_bufs, w_bufs, ready, empty, it, t_desc, u_desc, STAGES, LR_STEPS)
            if HAS_BIAS:
                out = out + gl.expand_dims(bias, 1)
            if ROW_MAX == 1:
                _merge_row_max(out, rm_ptr, off_t, M)
            _store_transposed(out, c_smem, out_desc, off_t, off_w)
            if ROW_MAX == 2:
                _merge_row_max_staged(c_smem, rm_ptr, off_t, M)
        tma.store_wait(0)

    @gluon.jit
    def w4a8_persistent_kernel(x_desc, w_desc, xs_ptr, ws_ptr, t_desc, u_desc, b_ptr, out_desc, rm_ptr, M, N, K,
                               W_SCALE_MUL: gl.constexpr, LR_STEPS: gl.constexpr, HAS_BIAS: gl.constexpr,
                               STAGES: gl.constexpr, GROUP_T: gl.constexpr, INSTR_N: gl.constexpr,
                               UNPACK: gl.constexpr, LOADER_REGS: gl.constexpr, ROW_MAX: gl.constexpr,
                               num_warps: gl.constexpr):
        """Persistent program: shared ring and barriers, then the loader and consumer partitions."""
        x_bufs = gl.allocate_shared_memory(gl.int8, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.int8, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        c_smem = gl.allocate_shared_memory(gl.bfloat16, out_desc.block_type.shape, out_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([  # argument tuples inline: a tuple assigned to a name would turn constexprs into tensors
            (_consumer_partition, (x_bufs, w_bufs, ready, empty, c_smem, out_desc, t_desc, u_desc, xs_ptr, ws_ptr,
                                   b_ptr, rm_ptr, M, N, K, W_SCALE_MUL, LR_STEPS, HAS_BIAS, GROUP_T, STAGES, INSTR_N,
                                   UNPACK, ROW_MAX, num_warps)),
            (_loader_partition, (x_desc, w_desc, t_desc, u_desc, x_bufs, w_bufs, ready, empty, M, N, K, GROUP_T, STAGES,
                                 LR_STEPS)),
        ], [1], [LOADER_REGS])


#: Registers requested for the loader warp (the consumer warpgroups keep the rest).
LOADER_REGISTERS: Final = 40

__all__ = ["GLUON_AVAILABLE", "LOADER_REGISTERS"]
