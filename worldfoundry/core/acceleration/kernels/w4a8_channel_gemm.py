"""The per-output-channel W4A8 GEMM (Triton): one int32 accumulation over the whole ``K``, scales in the epilogue.

``out = s_x[m] * s_w[n] * (q_x[m] · q_R[n]) + t @ U.T + b`` for a residual quantized with one scale per output
channel (``group_size = 0``; packed in blocks of 128 input features, layout in
:mod:`worldfoundry.core.acceleration.quantization.int4_packing`):

* main loop, one packing block (or ``PACKS`` of them) per step: load the packed bytes and two 64-wide halves of the
  activation codes, unpack to ``16 * code`` in registers (:mod:`.w4a8_tiles`), and ``acc = tl.dot(w, x, acc)``
  twice with an int32 accumulator -- no float work, so consecutive tensor-core MMAs need not wait on each other and
  Triton pipelines the loads (``num_stages``);
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
from worldfoundry.core.acceleration.quantization.int4_packing import CHANNEL_PACK_BLOCK
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
    def _w4a8_channel_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, t_ptr, lu_ptr, b_ptr, out_ptr, M, N, K,
                             RANK: tl.constexpr, HAS_LR: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, WIDEN: tl.constexpr,
                             ASM: tl.constexpr = False, PACKS: tl.constexpr = 1):
        offs_m, offs_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        mmask = offs_m < M
        nmask = offs_n < N
        HALF: tl.constexpr = 64  # half of the 128-wide packing block
        kh = tl.arange(0, HALF)
        x_rows = offs_m.to(tl.int64) * K
        w_rows = offs_n.to(tl.int64) * (K // 2)
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for step in range(0, K // (2 * HALF * PACKS)):
            for j in tl.static_range(PACKS):
                blk = step * PACKS + j
                k0 = blk * 2 * HALF
                if SWAP_AB:
                    p = tl.load(wq_ptr + w_rows[:, None] + (blk * HALF + kh)[None, :], mask=nmask[:, None], other=0)
                    xa = tl.load(xq_ptr + x_rows[None, :] + (k0 + kh)[:, None], mask=mmask[None, :], other=0)
                    xb = tl.load(xq_ptr + x_rows[None, :] + (k0 + HALF + kh)[:, None], mask=mmask[None, :], other=0)
                    acc = tl.dot(_low_nibble_x16(p, ASM), xa, acc, out_dtype=tl.int32)
                    acc = tl.dot(_high_nibble_x16(p, ASM), xb, acc, out_dtype=tl.int32)
                else:
                    p = tl.load(wq_ptr + w_rows[None, :] + (blk * HALF + kh)[:, None], mask=nmask[None, :], other=0)
                    xa = tl.load(xq_ptr + x_rows[:, None] + (k0 + kh)[None, :], mask=mmask[:, None], other=0)
                    xb = tl.load(xq_ptr + x_rows[:, None] + (k0 + HALF + kh)[None, :], mask=mmask[:, None], other=0)
                    acc = tl.dot(xa, _low_nibble_x16(p, ASM), acc, out_dtype=tl.int32)
                    acc = tl.dot(xb, _high_nibble_x16(p, ASM), acc, out_dtype=tl.int32)
        s = tl.load(ws_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32) * 0.0625
        if SWAP_AB:
            accf = acc.to(tl.float32) * s[:, None]
        else:
            accf = acc.to(tl.float32) * s[None, :]
        _w4a8_epilogue(accf, offs_m, offs_n, xs_ptr, t_ptr, lu_ptr, b_ptr, out_ptr, M, N, RANK, HAS_LR, HAS_BIAS,
                       SWAP_AB, WIDEN)


def _cfg(bm: int, bn: int, swap: bool, warps: int, stages: int, packs: int = 1) -> dict[str, Any]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "SWAP_AB": swap, "PACKS": packs, "num_warps": warps,
            "num_stages": stages}


#: Candidates timed on CUDA (:mod:`.w4a8_tuning`). Mostly ``SWAP_AB`` (the unpacked weights stay in registers as
#: wgmma's A operand; the other orientation writes them to shared memory every step, two such tiles kept). The
#: int32 accumulator of a 128x256 tile is 128 registers per thread at 8 warps; 256x256 would spill.
CHANNEL_CONFIGS: Final = [
    _cfg(128, 128, True, 8, 4), _cfg(128, 128, True, 8, 3, 2), _cfg(256, 128, True, 8, 3),
    _cfg(128, 256, True, 8, 3), _cfg(128, 128, True, 4, 4), _cfg(64, 128, True, 4, 4), _cfg(128, 64, True, 4, 5),
    _cfg(128, 128, False, 8, 4), _cfg(256, 128, False, 8, 3),
]
#: Tile under the Triton interpreter (CPU tests).
CHANNEL_INTERPRETER_CONFIG: Final = _cfg(32, 32, False, 4, 1) | {"GROUP_M": 2}


def check_channel_k(k: int, packs: int = 1) -> None:
    """Raise unless ``K`` fits the int32 accumulator and is a multiple of ``128 * PACKS``.

    Raises:
        QuantizationInputError: naming ``K`` and the limit.
    """
    if k > MAX_CHANNEL_K:
        raise QuantizationInputError(f"per-channel W4A8 GEMM: in_features {k} exceeds {MAX_CHANNEL_K} "
                                     "(int32 accumulator); use group_size 64 or 128")
    if k % (CHANNEL_PACK_BLOCK * packs):
        raise QuantizationInputError(f"per-channel W4A8 GEMM: in_features {k} is not a multiple of "
                                     f"{CHANNEL_PACK_BLOCK * packs} (PACKS={packs})")


def launch_channel_gemm(args: tuple[Any, ...], flags: dict[str, Any], config: dict[str, Any], m: int, n: int) -> None:
    """One launch of the per-channel kernel with a fixed tile (``config`` may set ``ASM``, ``PACKS``)."""
    cfg, warps, stages = split_launch_options(config)
    run_flags = dict(flags)
    if "ASM" in cfg:  # a config may pin the unpacking variant (benchmark comparison); never under the interpreter
        run_flags["ASM"] = bool(cfg.pop("ASM")) and flags["ASM"]
    check_channel_k(int(args[-1]), int(cfg.get("PACKS", 1)))
    _w4a8_channel_kernel[grid_for(m, n, cfg)](*args, **run_flags, **cfg, num_warps=warps, num_stages=stages)


def channel_candidates(k: int) -> list[dict[str, Any]]:
    """:data:`CHANNEL_CONFIGS` whose ``PACKS`` divides ``K / 128``."""
    return [c for c in CHANNEL_CONFIGS if k % (CHANNEL_PACK_BLOCK * c["PACKS"]) == 0]



__all__ = ["CHANNEL_CONFIGS", "CHANNEL_INTERPRETER_CONFIG", "MAX_CHANNEL_K", "channel_candidates",
           "check_channel_k", "launch_channel_gemm"]
