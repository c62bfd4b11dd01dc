"""The per-output-channel W4A8 GEMM (Triton): one int32 accumulation over the whole ``K``, scales in the epilogue.

``out = s_x[m] * s_w[n] * (q_x[m] · q_R[n]) + t @ U.T + b`` for a residual quantized with one scale per output
channel (``group_size = 0``; packed in blocks of 128 input features, layout in
:mod:`worldfoundry.core.acceleration.quantization.int4_packing`):

* main loop, ``BLOCK_K`` (128 or 256) input features per step: load ``[BLOCK_N, BLOCK_K/2]`` packed bytes and a
  ``[BLOCK_K, BLOCK_M]`` activation-code tile, unpack the byte pairs to ``16 * code`` in K order in registers
  (``join`` + ``reshape``), and one ``acc = tl.dot(w, x, acc)`` with an int32 accumulator -- no float work; Triton
  pipelines the loads (``num_stages``). (Triton 3.6 still waits for each int8 ``wgmma`` before the next step --
  its pipeliner makes int8 dots synchronous even with both operands in shared memory, seen in the compiled
  TTGIR --, so overlap comes from several programs per SM; one dot per step keeps those waits to one per step);
* epilogue: ``float32(acc) * (s_w[n] / 16)`` (the 16 of the unpacking, exact), ``* s_x[m]``, the fused low-rank
  up projection, bias, cast. ``|acc| <= 16 * 8 * 127 * K < 2**31`` needs ``K <= 131,072`` (checked).

The residual part before the low-rank addition is bitwise
:func:`~worldfoundry.core.acceleration.quantization.svdquant_numerics.int4_gemm_reference`'s (the int32 is exact,
its float32 rounding and the two products are the same operations in the same order).
"""

from __future__ import annotations

from typing import Any, Final

from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE
from worldfoundry.core.acceleration.kernels.w4a8_tiles import grid_for, split_launch_options
from worldfoundry.core.acceleration.quantization.int4_packing import CHANNEL_K_MULTIPLE
from worldfoundry.errors import QuantizationInputError

#: Largest ``K`` whose ``16 * 8 * 127 * K`` fits the int32 accumulator.
MAX_CHANNEL_K: Final = 131072

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from worldfoundry.core.acceleration.kernels.w4a8_tiles import (
        _high_nibble_x16,
        _low_nibble_x16,
        _tile,
        _w4a8_epilogue,
    )

    @triton.jit
    def _unpack_pairs_x16(p, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
        """``[ROWS, BLOCK_K / 2]`` paired bytes -> ``[ROWS, BLOCK_K]`` int8 ``16 * code`` in K order (join: no moves)."""
        return tl.reshape(tl.join(_low_nibble_x16(p, ASM), _high_nibble_x16(p, ASM)), [ROWS, BLOCK_K])

    @triton.jit
    def _w4a8_channel_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, t_ptr, lu_ptr, b_ptr, out_ptr, M, N, K,
                             RANK: tl.constexpr, HAS_LR: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, WIDEN: tl.constexpr,
                             ASM: tl.constexpr = False, BLOCK_K: tl.constexpr = 128, ACT_GROUPS: tl.constexpr = 0):
        offs_m, offs_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        mmask = offs_m < M
        nmask = offs_n < N
        KH: tl.constexpr = BLOCK_K // 2
        kb = tl.arange(0, KH)
        kf = tl.arange(0, BLOCK_K)
        x_rows = offs_m.to(tl.int64) * K
        w_rows = offs_n.to(tl.int64) * (K // 2)
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        accg = acc.to(tl.float32)  # ACT_GROUPS: float32(step sum) * s_x[m, step], summed in order
        for step in range(0, K // BLOCK_K):
            k0 = step * BLOCK_K
            p = tl.load(wq_ptr + w_rows[:, None] + (step * KH + kb)[None, :], mask=nmask[:, None], other=0)
            w = _unpack_pairs_x16(p, BLOCK_N, BLOCK_K, ASM)
            if SWAP_AB:
                x = tl.load(xq_ptr + x_rows[None, :] + (k0 + kf)[:, None], mask=mmask[None, :], other=0)
                if ACT_GROUPS:  # one activation group per step: its exact int32 sum, scaled (the reference's order)
                    sx = tl.load(xs_ptr + offs_m.to(tl.int64) * ACT_GROUPS + step, mask=mmask, other=0.0)
                    accg += tl.dot(w, x, tl.zeros_like(acc), out_dtype=tl.int32).to(tl.float32) * sx[None, :]
                else:
                    acc = tl.dot(w, x, acc, out_dtype=tl.int32)
            else:
                x = tl.load(xq_ptr + x_rows[:, None] + (k0 + kf)[None, :], mask=mmask[:, None], other=0)
                if ACT_GROUPS:
                    sx = tl.load(xs_ptr + offs_m.to(tl.int64) * ACT_GROUPS + step, mask=mmask, other=0.0)
                    accg += tl.dot(x, tl.trans(w), tl.zeros_like(acc), out_dtype=tl.int32).to(tl.float32) * sx[:, None]
                else:
                    acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.int32)
        s = tl.load(ws_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32) * 0.0625
        if ACT_GROUPS == 0:
            accg = acc.to(tl.float32)
        if SWAP_AB:
            accf = accg * s[:, None]
        else:
            accf = accg * s[None, :]
        _w4a8_epilogue(accf, offs_m, offs_n, xs_ptr, t_ptr, lu_ptr, b_ptr, out_ptr, M, N, RANK, HAS_LR, HAS_BIAS,
                       SWAP_AB, WIDEN, ACT_GROUPS == 0)


def _cfg(bm: int, bn: int, swap: bool, warps: int, stages: int, block_k: int = 128) -> dict[str, Any]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "SWAP_AB": swap, "BLOCK_K": block_k, "num_warps": warps,
            "num_stages": stages}


#: Candidates timed on CUDA (:mod:`.w4a8_tuning`); ``(BLOCK_M tokens, BLOCK_N weights, SWAP_AB, warps, stages,
#: BLOCK_K)``. None spills on sm_90 (``ptxas -v`` with Triton 3.6: 125-241 registers; 256x256 and a 4-warp
#: 128x128 tile with ``BLOCK_K`` 256 spill and are left out). Several fit two or more programs per SM
#: (e.g. 128x128 at 8 warps: 125 registers, 88 KB shared memory), so one program's unpacking overlaps another's
#: MMAs. Mostly ``SWAP_AB``: the unpacked weights stay in registers as wgmma's A operand; the other orientation
#: stores them to shared memory every step (two such tiles kept).
CHANNEL_CONFIGS: Final = [
    _cfg(128, 128, True, 8, 4), _cfg(128, 128, True, 8, 3), _cfg(128, 128, True, 8, 3, 256),
    _cfg(256, 128, True, 8, 3), _cfg(128, 256, True, 8, 3), _cfg(128, 128, True, 4, 3), _cfg(64, 128, True, 4, 4),
    _cfg(128, 64, True, 4, 5), _cfg(64, 64, True, 4, 4), _cfg(64, 128, True, 4, 3, 256), _cfg(64, 64, True, 4, 4, 256),
    _cfg(128, 128, False, 8, 4), _cfg(256, 128, False, 8, 3),
]
#: Tile under the Triton interpreter (CPU tests).
CHANNEL_INTERPRETER_CONFIG: Final = _cfg(32, 32, False, 4, 1) | {"GROUP_M": 2}


def check_channel_k(k: int, block_k: int = CHANNEL_K_MULTIPLE) -> None:
    """Raise unless ``K`` fits the int32 accumulator and is a multiple of the K step ``block_k``.

    Raises:
        QuantizationInputError: naming ``K`` and the limit.
    """
    if k > MAX_CHANNEL_K:
        raise QuantizationInputError(f"per-channel W4A8 GEMM: in_features {k} exceeds {MAX_CHANNEL_K} "
                                     "(int32 accumulator); use group_size 64 or 128")
    if k % block_k:
        raise QuantizationInputError(f"per-channel W4A8 GEMM: in_features {k} is not a multiple of the K step "
                                     f"{block_k}")


def launch_channel_gemm(args: tuple[Any, ...], flags: dict[str, Any], config: dict[str, Any], m: int, n: int) -> None:
    """One launch of the per-channel kernel with a fixed tile (``config`` may set ``ASM``, ``BLOCK_K``)."""
    cfg, warps, stages = split_launch_options(config)
    run_flags = dict(flags)
    if "ASM" in cfg:  # a config may pin the unpacking variant (benchmark comparison); never under the interpreter
        run_flags["ASM"] = bool(cfg.pop("ASM")) and flags["ASM"]
    check_channel_k(int(args[-1]), int(cfg.get("BLOCK_K", CHANNEL_K_MULTIPLE)))
    _w4a8_channel_kernel[grid_for(m, n, cfg)](*args, **run_flags, **cfg, num_warps=warps, num_stages=stages)


def channel_candidates(k: int) -> list[dict[str, Any]]:
    """:data:`CHANNEL_CONFIGS` whose ``BLOCK_K`` divides ``K``."""
    return [c for c in CHANNEL_CONFIGS if k % c["BLOCK_K"] == 0]



__all__ = ["CHANNEL_CONFIGS", "CHANNEL_INTERPRETER_CONFIG", "MAX_CHANNEL_K", "channel_candidates",
           "check_channel_k", "launch_channel_gemm"]
