"""Device code of the ping-pong W4A8 GEMM for Hopper in Gluon: two consumer warpgroups take alternate tiles.

**Status: correct on an H200 (its CUDA tests pass), 2.2x slower than the persistent kernel** with the turns. The
turns cover the INT4 unpacking, so only one warpgroup unpacks at a time; ``TAKE_TURNS=False`` (``turns=False`` of
the tile) lets both consumers run their main loops at once -- not yet run on a GPU.

The schedule differs from :mod:`.w4a8_gluon_persistent_kernels` (whose tile order, INT4 unpacking and output store
are reused from there) in how the work is shared:

* **two consumer partitions**, one warpgroup each (8 warps per program), each with its own accumulator, TMA ring of
  ``STAGES`` slots (``ready`` mbarriers) and output tile. A program's tiles ``j = 0, 1, 2, ...``
  (``tile = pid + j * P``) alternate between them: consumer 0 takes the even ``j``, consumer 1 the odd ones;
* **ping-pong**: two ``turn`` mbarriers pass the main loop back and forth (consumer 0 starts; each arrives on the
  other's after its last MMA of a tile has retired), so one consumer's epilogue (scaling, low-rank ``wgmma``, bias,
  TMA store) runs beside the other's main loop and the tensor cores are not left idle during epilogues;
* **no loader warp**: each consumer streams its own tiles' K steps and low-rank chunks through its ring, ``STAGES - 1``
  entries ahead, and refills a slot as soon as the MMA that read it has retired (``warpgroup_mma_wait(1)``), so no
  ``empty`` barriers and no arrive are needed. Why: with a one-warp loader the program has 9 warps (12 allocated),
  a register limit of 168 per thread at launch, and ``ptxas`` then serialises every ``wgmma`` of a *worker* partition
  ("insufficient register resources", even for a 64 x 32 tile); with 8 warps the limit is 256 and it does not;
* the register discipline of the persistent kernel is kept: the INT4 weights are unpacked into the ``wgmma``
  register operand; one MMA stays in flight while the next slot is unpacked into *other* registers (the loop body
  holds two K steps, since ``ptxas`` does not keep an in-flight MMA's register operand from being overwritten),
  and the odd step left over runs after the loop.

Triton inserts warpgroup-local named barriers (``bar.sync id, 128``) around the ring's mbarrier waits and TMA issues
of each consumer; no barrier spans both consumers inside a K loop.

Each consumer tile is ``[BLOCK_W outputs, BLOCK_T tokens]`` of ``out.T`` held by one warpgroup (at most 128 int32
accumulator registers per thread). Numerics equal :mod:`.w4a8_gluon_persistent_kernels`. Gluon compiles for CUDA
only; the Triton interpreter does not run it. Importing this module needs no GPU.
"""

from __future__ import annotations

from typing import Final

from worldfoundry.core.acceleration.kernels.w4a8_gluon_kernels import GLUON_AVAILABLE

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent_kernels import (
        _store_transposed,
        _tile_offsets,
        _weight_operand,
    )

    @gluon.jit
    def _load_pair(desc_a, desc_b, x_bufs, w_bufs, bar, slot, coord_a, coord_b):
        """TMA one ``desc_a`` box to the activation buffer of ``slot`` and one ``desc_b`` box to its weight buffer
        (reinterpreted when the boxes are the low-rank bfloat16 tiles), both completing ``bar``."""
        mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes)
        a_view = x_bufs.index(slot)._reinterpret(desc_a.dtype, desc_a.block_type.shape, desc_a.layout)
        b_view = w_bufs.index(slot)._reinterpret(desc_b.dtype, desc_b.block_type.shape, desc_b.layout)
        tma.async_copy_global_to_shared(desc_a, coord_a, bar, a_view)
        tma.async_copy_global_to_shared(desc_b, coord_b, bar, b_view)

    @gluon.jit
    def _issue(descs, x_bufs, w_bufs, ready, n, stream, CONSUMER: gl.constexpr, STAGES: gl.constexpr,
               GROUP_T: gl.constexpr, LR_STEPS: gl.constexpr):
        """TMA of entry ``n`` of this consumer's stream (a K step or a low-rank chunk of one of its tiles, in order)
        into ring slot ``n % STAGES``; nothing past the end of the stream."""
        x_desc, w_desc, t_desc, u_desc = descs
        length, steps, num_k, num_t, num_w = stream
        BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_W: gl.constexpr = w_desc.block_type.shape[0]
        W_BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        if n < length:
            j = n // steps
            step = n - j * steps
            tile = gl.program_id(0) + (2 * j + CONSUMER) * gl.num_programs(0)
            off_t, off_w = _tile_offsets(tile, num_t, num_w, BLOCK_T, BLOCK_W, GROUP_T)
            slot = n % STAGES
            bar = ready.index(slot)
            if LR_STEPS == 0:
                _load_pair(x_desc, w_desc, x_bufs, w_bufs, bar, slot, [off_t, step * BLOCK_K],
                           [off_w, step * W_BLOCK_K])
            else:
                if step < num_k:
                    _load_pair(x_desc, w_desc, x_bufs, w_bufs, bar, slot, [off_t, step * BLOCK_K],
                               [off_w, step * W_BLOCK_K])
                else:
                    chunk = (step - num_k) * t_desc.block_type.shape[1]
                    _load_pair(t_desc, u_desc, x_bufs, w_bufs, bar, slot, [off_t, chunk], [off_w, chunk])

    @gluon.jit
    def _k_step(descs, x_bufs, w_bufs, ready, acc, it, stream, acc_layout: gl.constexpr, CONSUMER: gl.constexpr,
                STAGES: gl.constexpr, GROUP_T: gl.constexpr, LR_STEPS: gl.constexpr, UNPACK: gl.constexpr):
        """K step ``it``: unpack its weights while MMA ``it - 1`` runs, issue MMA ``it``, retire ``it - 1``, then
        refill the slot ``it - 1`` used with entry ``it + STAGES - 1``."""
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        a = _weight_operand(w_bufs.index(slot), acc_layout, UNPACK)
        acc = warpgroup_mma(a, x_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        _issue(descs, x_bufs, w_bufs, ready, it + STAGES - 1, stream, CONSUMER, STAGES, GROUP_T, LR_STEPS)
        return acc

    @gluon.jit
    def _main_loop(descs, x_bufs, w_bufs, ready, it, stream, acc_layout: gl.constexpr, CONSUMER: gl.constexpr,
                   STAGES: gl.constexpr, GROUP_T: gl.constexpr, LR_STEPS: gl.constexpr, UNPACK: gl.constexpr):
        """int32 ``acc = W8 @ X.T`` of one tile over ``num_k`` stream entries starting at ``it``.

        Consecutive K steps must not share the registers of their ``A`` operand (one MMA is in flight while the next
        operand is written), so the loop body holds two steps and the odd step left over runs after the loop.
        """
        BLOCK_T: gl.constexpr = x_bufs.type.shape[1]
        BLOCK_W: gl.constexpr = w_bufs.type.shape[1]
        num_k = stream[2]
        acc = gl.zeros([BLOCK_W, BLOCK_T], gl.int32, acc_layout)
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        a = _weight_operand(w_bufs.index(slot), acc_layout, UNPACK)
        acc = warpgroup_mma(a, x_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))  # nothing to wait for yet: the loop carries a plain tensor
        _issue(descs, x_bufs, w_bufs, ready, it + STAGES - 1, stream, CONSUMER, STAGES, GROUP_T, LR_STEPS)
        for j in range((num_k - 1) // 2):
            acc = _k_step(descs, x_bufs, w_bufs, ready, acc, it + 1 + 2 * j, stream, acc_layout, CONSUMER, STAGES,
                          GROUP_T, LR_STEPS, UNPACK)
            acc = _k_step(descs, x_bufs, w_bufs, ready, acc, it + 2 + 2 * j, stream, acc_layout, CONSUMER, STAGES,
                          GROUP_T, LR_STEPS, UNPACK)
        if (num_k - 1) % 2 == 1:
            acc = _k_step(descs, x_bufs, w_bufs, ready, acc, it + num_k - 1, stream, acc_layout, CONSUMER, STAGES,
                          GROUP_T, LR_STEPS, UNPACK)
        return warpgroup_mma_wait(0, deps=(acc, ))

    @gluon.jit
    def _add_lowrank(out, descs, x_bufs, w_bufs, ready, it, stream, CONSUMER: gl.constexpr, STAGES: gl.constexpr,
                     GROUP_T: gl.constexpr, LR_STEPS: gl.constexpr):
        """``out + U @ t.T`` from the ``LR_STEPS`` stream entries at ``it`` (bfloat16 ``wgmma``, float32)."""
        t_desc = descs[2]
        u_desc = descs[3]
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
            _issue(descs, x_bufs, w_bufs, ready, it + c + STAGES - 1, stream, CONSUMER, STAGES, GROUP_T, LR_STEPS)
        return gl.convert_layout(acc, parent)

    @gluon.jit
    def _consumer_partition(x_desc, w_desc, t_desc, u_desc, x_bufs, w_bufs, ready, turn, c_smem, out_desc, xs_ptr,
                            ws_ptr, b_ptr, M, N, K, CONSUMER: gl.constexpr, W_SCALE_MUL: gl.constexpr,
                            LR_STEPS: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_T: gl.constexpr,
                            STAGES: gl.constexpr, INSTR_N: gl.constexpr, UNPACK: gl.constexpr,
                            TAKE_TURNS: gl.constexpr):
        """One warpgroup: its own TMA ring and tiles ``j = CONSUMER, CONSUMER + 2, ...`` of this program; with
        ``TAKE_TURNS`` the main loops of the two consumers take turns (``turn`` barriers) and each epilogue runs
        beside the other's main loop; without, both run whenever their data is ready (nothing is shared)."""
        BLOCK_T: gl.constexpr = x_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = x_bufs.type.shape[2]
        BLOCK_W: gl.constexpr = w_bufs.type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, INSTR_N, 32])
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        num_t = gl.cdiv(M, BLOCK_T)
        num_w = gl.cdiv(N, BLOCK_W)
        num_k = K // BLOCK_K
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        mine = (gl.cdiv(num_t * num_w - pid, programs) - CONSUMER + 1) // 2  # this consumer's tiles
        steps = num_k + LR_STEPS
        stream = (mine * steps, steps, num_k, num_t, num_w)
        descs = (x_desc, w_desc, t_desc, u_desc)
        for n in range(STAGES - 1):
            _issue(descs, x_bufs, w_bufs, ready, n, stream, CONSUMER, STAGES, GROUP_T, LR_STEPS)
        for i in range(mine):
            tile = pid + (2 * i + CONSUMER) * programs
            off_t, off_w = _tile_offsets(tile, num_t, num_w, BLOCK_T, BLOCK_W, GROUP_T)
            offs_w = off_w + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, acc_layout))
            wmask = offs_w < N
            ws = gl.load(ws_ptr + offs_w, mask=wmask, other=0.0).to(gl.float32) * W_SCALE_MUL
            offs_tp = off_t + gl.arange(0, BLOCK_T, layout=flat)  # compact: one register, not one per acc column
            xs = gl.load(xs_ptr + offs_tp, mask=offs_tp < M, other=0.0)
            if HAS_BIAS:
                bias = gl.load(b_ptr + offs_w, mask=wmask, other=0.0).to(gl.float32)
            if TAKE_TURNS:  # consumer 0 starts, then they alternate
                mbarrier.wait(turn.index(CONSUMER), (i & 1) ^ (1 - CONSUMER))
            acc = _main_loop(descs, x_bufs, w_bufs, ready, i * steps, stream, acc_layout, CONSUMER, STAGES, GROUP_T,
                             LR_STEPS, UNPACK)
            if TAKE_TURNS:
                mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
            xs = gl.convert_layout(xs, gl.SliceLayout(0, acc_layout))
            out = acc.to(gl.float32) * gl.expand_dims(ws, 1) * gl.expand_dims(xs, 0)
            if LR_STEPS > 0:
                out = _add_lowrank(out, descs, x_bufs, w_bufs, ready, i * steps + num_k, stream, CONSUMER, STAGES,
                                   GROUP_T, LR_STEPS)
            if HAS_BIAS:
                out = out + gl.expand_dims(bias, 1)
            _store_transposed(out, c_smem, out_desc, off_t, off_w)
        tma.store_wait(0)

    @gluon.jit
    def w4a8_pingpong_kernel(x_desc, w_desc, xs_ptr, ws_ptr, t_desc, u_desc, b_ptr, out_desc, M, N, K,
                             W_SCALE_MUL: gl.constexpr, LR_STEPS: gl.constexpr, HAS_BIAS: gl.constexpr,
                             STAGES: gl.constexpr, GROUP_T: gl.constexpr, INSTR_N: gl.constexpr,
                             UNPACK: gl.constexpr, TAKE_TURNS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             num_warps: gl.constexpr):
        """Persistent program of 8 warps: two rings, their barriers, the turn barriers, two output tiles, then the
        two consumer partitions (``STAGES`` slots per consumer)."""
        gl.static_assert(num_warps == 4, "the ping-pong kernel runs one warpgroup per consumer (num_warps=4)")
        x_first = gl.allocate_shared_memory(gl.int8, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_first = gl.allocate_shared_memory(gl.int8, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        x_second = gl.allocate_shared_memory(gl.int8, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_second = gl.allocate_shared_memory(gl.int8, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        c_first = gl.allocate_shared_memory(gl.bfloat16, out_desc.block_type.shape, out_desc.layout)
        c_second = gl.allocate_shared_memory(gl.bfloat16, out_desc.block_type.shape, out_desc.layout)
        r_first = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        r_second = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(r_first.index(i), count=1)
            mbarrier.init(r_second.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        gl.warp_specialize([  # argument tuples inline: a tuple assigned to a name would turn constexprs into tensors
            (_consumer_partition, (x_desc, w_desc, t_desc, u_desc, x_first, w_first, r_first, turn, c_first, out_desc,
                                   xs_ptr, ws_ptr, b_ptr, M, N, K, 0, W_SCALE_MUL, LR_STEPS, HAS_BIAS, GROUP_T, STAGES,
                                   INSTR_N, UNPACK, TAKE_TURNS)),
            (_consumer_partition, (x_desc, w_desc, t_desc, u_desc, x_second, w_second, r_second, turn, c_second,
                                   out_desc, xs_ptr, ws_ptr, b_ptr, M, N, K, 1, W_SCALE_MUL, LR_STEPS, HAS_BIAS,
                                   GROUP_T, STAGES, INSTR_N, UNPACK, TAKE_TURNS)),
        ], [4], [CONSUMER_REGS])


#: Registers requested for the second consumer warpgroup (the first, the default partition, keeps up to 256).
CONSUMER_REGISTERS: Final = 240

__all__ = ["CONSUMER_REGISTERS", "GLUON_AVAILABLE"]
