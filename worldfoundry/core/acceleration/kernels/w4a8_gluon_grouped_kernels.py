"""Device code of the persistent W4A8 GEMM for Hopper in Gluon with **activation scales per token and K group**.

``out[m, n] = s_w[n] * sum_g float32(q_x[m, g] . q_w[n, g]) * s_x[m, g]`` (groups of ``GROUP_STEPS * BLOCK_K``
input features, summed in order in float32; :func:`~worldfoundry.core.acceleration.quantization.svdquant_numerics.
int4_gemm_reference_grouped`'s operations). The schedule is :mod:`.w4a8_gluon_persistent_kernels`' (one program per
SM, a loader warp filling a TMA ring, the INT4 weights unpacked into the ``wgmma`` register operand, tiles
``[BLOCK_W outputs, BLOCK_T tokens]`` of ``out.T``, the low-rank term as a bfloat16 ``wgmma`` onto the float32 tile,
the TMA store left in flight), with the scaling moved into the main loop:

* **two int32 accumulators** take the groups in turn. A group's integer sum ``P`` (``|P| <= 16 * 8 * 127 * 256 <
  2**22``) plus the bits of the float ``1.5 * 2**23`` (``0x4B400000``) is that float plus ``P``, so subtracting
  ``1.5 * 2**23`` gives ``float32(P)`` exactly: an integer and a float addition instead of the quarter-rate
  ``cvt``;
* **promotion off the tensor cores' path**: the first MMA of group ``g + 1`` is issued into the other accumulator
  before group ``g``'s is read; ``warpgroup_mma_wait(1)`` then retires group ``g``'s last MMA only, the second MMA
  of group ``g + 1`` is issued, and group ``g``'s promotion (``acc_f = acc_f + (float(P) * s_x[:, g])``: one
  integer and three float operations per element, no FMA so the roundings are the reference's; or an FMA,
  ``EXACT=False``) runs on the CUDA cores while those two MMAs run. Each group's first MMA ignores what the
  accumulator holds (``use_acc=False``): ``ptxas`` serialises every ``wgmma`` when another instruction writes an
  accumulator register inside a pipeline stage, so the accumulator is never reset by hand;
* **the scales come with the data**: the loader copies the row ``s_x[g, tokens of the tile]`` of the transposed
  scales ``[G, M]`` (float32, rows 16-byte aligned) into the ring slot with each K step; group ``g`` is promoted
  from the slot of its last K step, which is released only after the promotion.

Registers per consumer thread: three accumulators of ``BLOCK_W * BLOCK_T / (32 * warps)`` values and two ``A``
operands. Numerics: without the low-rank term and bias the output is ``bf16`` of
``int4_gemm_reference_grouped`` bitwise (launched without FMA contraction). Gluon compiles for CUDA only; importing
this module needs no GPU.
"""

from __future__ import annotations

from typing import Final

from worldfoundry.core.acceleration.kernels.w4a8_gluon_kernels import GLUON_AVAILABLE

#: int32 bits of the float ``1.5 * 2**23``: an accumulator started there holds ``float(1.5 * 2**23 + P)``.
FLOAT_BIAS_BITS: Final = 0x4B400000
FLOAT_BIAS: Final = 12582912.0

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent_kernels import (
        _add_lowrank,
        _load_slot,
        _release,
        _store_transposed,
        _tile_offsets,
        _weight_operand,
    )

    _BIAS_BITS = gl.constexpr(FLOAT_BIAS_BITS)
    _BIAS = gl.constexpr(FLOAT_BIAS)

    @gluon.jit
    def _load_step(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, it, off_t, off_w, k,
                   STAGES: gl.constexpr, GROUP_STEPS: gl.constexpr):
        """Wait until ring slot ``it`` is free, then TMA K step ``k``'s activation and packed weight boxes and the
        scale row of its group into it."""
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        W_BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        slot = it % STAGES
        mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_t, k * BLOCK_K], bar, x_bufs.index(slot))
        tma.async_copy_global_to_shared(w_desc, [off_w, k * W_BLOCK_K], bar, w_bufs.index(slot))
        tma.async_copy_global_to_shared(s_desc, [k // GROUP_STEPS, off_t], bar, s_bufs.index(slot))
        return it + 1

    @gluon.jit
    def _grouped_loader(x_desc, w_desc, s_desc, t_desc, u_desc, x_bufs, w_bufs, s_bufs, ready, empty, M, N, K,
                        GROUP_T: gl.constexpr, STAGES: gl.constexpr, LR_STEPS: gl.constexpr,
                        GROUP_STEPS: gl.constexpr):
        """TMA producer: every K step of every tile of this program (with its scale row), then the low-rank slots."""
        BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_W: gl.constexpr = w_desc.block_type.shape[0]
        num_t = gl.cdiv(M, BLOCK_T)
        num_w = gl.cdiv(N, BLOCK_W)
        num_k = K // BLOCK_K
        it = 0
        for tile in range(gl.program_id(0), num_t * num_w, gl.num_programs(0)):
            off_t, off_w = _tile_offsets(tile, num_t, num_w, BLOCK_T, BLOCK_W, GROUP_T)
            for k in range(num_k):
                it = _load_step(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, ready, empty, it, off_t, off_w, k,
                                STAGES, GROUP_STEPS)
            for c in gl.static_range(LR_STEPS):
                chunk = c * t_desc.block_type.shape[1]
                it = _load_slot(t_desc, u_desc, x_bufs, w_bufs, ready, empty, it, [off_t, chunk], [off_w, chunk],
                                STAGES)

    @gluon.jit
    def _promote(acc_f, acc, s_bufs, slot, acc_layout: gl.constexpr, EXACT: gl.constexpr):
        """``acc_f + float32(P) * s_x`` for the retired accumulator ``acc`` holding a group's integer sum ``P``,
        with the scale row held by ring slot ``slot``: rounded after the product (``EXACT``, the reference's
        order) or once (an FMA: one float operation less per element)."""
        BLOCK_T: gl.constexpr = s_bufs.type.shape[2]
        row = s_bufs.index(slot)._reinterpret(gl.float32, [BLOCK_T], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        s = gl.expand_dims(row.load(gl.SliceLayout(0, acc_layout)), 0)
        exact = (acc + _BIAS_BITS).to(gl.float32, bitcast=True) - _BIAS
        if EXACT:
            return acc_f + exact * s
        return gl.fma(exact, s, acc_f)

    @gluon.jit
    def _mma(x_bufs, w_bufs, ready, acc, it, acc_layout: gl.constexpr, STAGES: gl.constexpr,
             UNPACK: gl.constexpr, FIRST: gl.constexpr):
        """Unpack K step ``it``'s weights and issue its MMA into ``acc`` (asynchronous; a group's ``FIRST`` step
        ignores what ``acc`` holds)."""
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        a = _weight_operand(w_bufs.index(slot), acc_layout, UNPACK)
        return warpgroup_mma(a, x_bufs.index(slot).permute((1, 0)), acc, use_acc=not FIRST, is_async=True)

    @gluon.jit
    def _group(x_bufs, w_bufs, s_bufs, ready, empty, acc, other, acc_f, it, acc_layout: gl.constexpr,
               STAGES: gl.constexpr, UNPACK: gl.constexpr, GROUP_STEPS: gl.constexpr, EXACT: gl.constexpr):
        """One group's ``GROUP_STEPS`` K steps into ``acc`` from ring counter ``it``. The first is issued, which
        retires the previous group's accumulator ``other`` (``wait(1)``); with two or more steps the second is
        issued too (its operand's registers are those of ``other``'s last step, retired), so the promotion of
        ``other`` into ``acc_f`` runs beside two MMAs; then ``other``'s last slot (its scale row) is released."""
        acc = _mma(x_bufs, w_bufs, ready, acc, it, acc_layout, STAGES, UNPACK, True)
        acc, other = warpgroup_mma_wait(1, deps=(acc, other))
        last = (it + STAGES - 1) % STAGES
        if GROUP_STEPS > 1:
            acc = _mma(x_bufs, w_bufs, ready, acc, it + 1, acc_layout, STAGES, UNPACK, False)
        acc_f = _promote(acc_f, other, s_bufs, last, acc_layout, EXACT)
        _release(empty, last)
        if GROUP_STEPS > 1:
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            _release(empty, it % STAGES)
        for j in gl.static_range(2 if GROUP_STEPS > 1 else 1, GROUP_STEPS):
            acc = _mma(x_bufs, w_bufs, ready, acc, it + j, acc_layout, STAGES, UNPACK, False)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            _release(empty, (it + j + STAGES - 1) % STAGES)
        return acc, other, acc_f

    @gluon.jit
    def _first_group(x_bufs, w_bufs, ready, empty, acc, it, acc_layout: gl.constexpr, STAGES: gl.constexpr,
                     UNPACK: gl.constexpr, GROUP_STEPS: gl.constexpr):
        """A tile's group 0 into ``acc``: nothing to promote yet."""
        acc = _mma(x_bufs, w_bufs, ready, acc, it, acc_layout, STAGES, UNPACK, True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        for j in gl.static_range(1, GROUP_STEPS):
            acc = _mma(x_bufs, w_bufs, ready, acc, it + j, acc_layout, STAGES, UNPACK, False)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            _release(empty, (it + j + STAGES - 1) % STAGES)
        return acc

    @gluon.jit
    def _grouped_main_loop(x_bufs, w_bufs, s_bufs, ready, empty, it, num_k, acc_layout: gl.constexpr,
                           STAGES: gl.constexpr, UNPACK: gl.constexpr, GROUP_STEPS: gl.constexpr,
                           EXACT: gl.constexpr):
        """float32 ``sum_g float(P_g) * s_x[:, g]`` of one tile over ``num_k`` ring slots from counter ``it``."""
        BLOCK_T: gl.constexpr = x_bufs.type.shape[1]
        BLOCK_W: gl.constexpr = w_bufs.type.shape[1]
        acc_a = gl.zeros([BLOCK_W, BLOCK_T], gl.int32, acc_layout)  # each group's first MMA ignores the values
        acc_b = gl.zeros([BLOCK_W, BLOCK_T], gl.int32, acc_layout)
        acc_f = gl.zeros([BLOCK_W, BLOCK_T], gl.float32, acc_layout)
        groups = num_k // GROUP_STEPS
        acc_a = _first_group(x_bufs, w_bufs, ready, empty, acc_a, it, acc_layout, STAGES, UNPACK, GROUP_STEPS)
        for j in range((groups - 1) // 2):
            base = it + (2 * j + 1) * GROUP_STEPS
            acc_b, acc_a, acc_f = _group(x_bufs, w_bufs, s_bufs, ready, empty, acc_b, acc_a, acc_f, base,
                                         acc_layout, STAGES, UNPACK, GROUP_STEPS, EXACT)
            acc_a, acc_b, acc_f = _group(x_bufs, w_bufs, s_bufs, ready, empty, acc_a, acc_b, acc_f,
                                         base + GROUP_STEPS, acc_layout, STAGES, UNPACK, GROUP_STEPS, EXACT)
        last = (it + num_k - 1) % STAGES
        if (groups - 1) % 2 == 1:  # an even group count: the last group goes to acc_b
            acc_b, acc_a, acc_f = _group(x_bufs, w_bufs, s_bufs, ready, empty, acc_b, acc_a, acc_f,
                                         it + num_k - GROUP_STEPS, acc_layout, STAGES, UNPACK, GROUP_STEPS, EXACT)
            acc_b = warpgroup_mma_wait(0, deps=(acc_b, ))
            acc_f = _promote(acc_f, acc_b, s_bufs, last, acc_layout, EXACT)
        else:
            acc_a = warpgroup_mma_wait(0, deps=(acc_a, ))
            acc_f = _promote(acc_f, acc_a, s_bufs, last, acc_layout, EXACT)
        _release(empty, last)
        return acc_f, it + num_k

    @gluon.jit
    def _grouped_consumer(x_bufs, w_bufs, s_bufs, ready, empty, c_smem, out_desc, t_desc, u_desc, ws_ptr, b_ptr,
                          M, N, K, W_SCALE_MUL: gl.constexpr, LR_STEPS: gl.constexpr, HAS_BIAS: gl.constexpr,
                          GROUP_T: gl.constexpr, STAGES: gl.constexpr, INSTR_N: gl.constexpr,
                          UNPACK: gl.constexpr, GROUP_STEPS: gl.constexpr, EXACT: gl.constexpr,
                          NUM_WARPS: gl.constexpr):
        """MMA warpgroups: the grouped main loop, then ``* s_w``, the low-rank term, bias and the TMA store."""
        BLOCK_T: gl.constexpr = x_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = x_bufs.type.shape[2]
        BLOCK_W: gl.constexpr = w_bufs.type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, INSTR_N, 32])
        num_t = gl.cdiv(M, BLOCK_T)
        num_w = gl.cdiv(N, BLOCK_W)
        num_k = K // BLOCK_K
        it = 0
        for tile in range(gl.program_id(0), num_t * num_w, gl.num_programs(0)):
            off_t, off_w = _tile_offsets(tile, num_t, num_w, BLOCK_T, BLOCK_W, GROUP_T)
            offs_w = off_w + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, acc_layout))
            wmask = offs_w < N
            ws = gl.load(ws_ptr + offs_w, mask=wmask, other=0.0).to(gl.float32) * W_SCALE_MUL
            if HAS_BIAS:
                bias = gl.load(b_ptr + offs_w, mask=wmask, other=0.0).to(gl.float32)
            acc_f, it = _grouped_main_loop(x_bufs, w_bufs, s_bufs, ready, empty, it, num_k, acc_layout, STAGES,
                                           UNPACK, GROUP_STEPS, EXACT)
            out = acc_f * gl.expand_dims(ws, 1)
            if LR_STEPS > 0:
                out, it = _add_lowrank(out, x_bufs, w_bufs, ready, empty, it, t_desc, u_desc, STAGES, LR_STEPS)
            if HAS_BIAS:
                out = out + gl.expand_dims(bias, 1)
            _store_transposed(out, c_smem, out_desc, off_t, off_w)
        tma.store_wait(0)

    @gluon.jit
    def w4a8_grouped_kernel(x_desc, w_desc, s_desc, ws_ptr, t_desc, u_desc, b_ptr, out_desc, M, N, K,
                            W_SCALE_MUL: gl.constexpr, LR_STEPS: gl.constexpr, HAS_BIAS: gl.constexpr,
                            STAGES: gl.constexpr, GROUP_T: gl.constexpr, INSTR_N: gl.constexpr,
                            UNPACK: gl.constexpr, GROUP_STEPS: gl.constexpr, EXACT: gl.constexpr,
                            LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """Persistent program: ring (activation, packed weight and scale-row buffers per slot), barriers, then the
        loader and consumer partitions."""
        x_bufs = gl.allocate_shared_memory(gl.int8, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.int8, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        s_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + s_desc.block_type.shape, s_desc.layout)
        c_smem = gl.allocate_shared_memory(gl.bfloat16, out_desc.block_type.shape, out_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([  # argument tuples inline: a tuple assigned to a name would turn constexprs into tensors
            (_grouped_consumer, (x_bufs, w_bufs, s_bufs, ready, empty, c_smem, out_desc, t_desc, u_desc, ws_ptr,
                                 b_ptr, M, N, K, W_SCALE_MUL, LR_STEPS, HAS_BIAS, GROUP_T, STAGES, INSTR_N, UNPACK,
                                 GROUP_STEPS, EXACT, num_warps)),
            (_grouped_loader, (x_desc, w_desc, s_desc, t_desc, u_desc, x_bufs, w_bufs, s_bufs, ready, empty, M, N,
                               K, GROUP_T, STAGES, LR_STEPS, GROUP_STEPS)),
        ], [1], [LOADER_REGS])


#: Registers requested for the loader warp (the consumer warpgroups keep the rest: three accumulators).
GROUPED_LOADER_REGISTERS: Final = 40

__all__ = ["FLOAT_BIAS", "FLOAT_BIAS_BITS", "GLUON_AVAILABLE", "GROUPED_LOADER_REGISTERS"]
