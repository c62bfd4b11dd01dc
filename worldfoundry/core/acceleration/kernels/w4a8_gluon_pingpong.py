"""Ping-pong W4A8 GEMM on Hopper (Gluon), host side: two consumer warpgroups taking alternate output tiles.

**Status: correct on an H200, and slower than the persistent kernel** -- its GPU tests pass (bitwise without the
low-rank term; the W81 shapes included), but ``benchmarks/kernels/w4a8_gluon.py --kernels pingpong`` measured
1.88 ms at every W81 FFN shape against 0.84-0.87 ms for :mod:`.w4a8_gluon_persistent` (``docs/performance.md``).
Nothing dispatches to it; it is kept as a measured variant. Its turns cover the INT4 unpacking, so only one warpgroup
unpacks at a time: ``PingPongTile(turns=False)`` runs both consumers' main loops at once (not yet run on a GPU; its
tests and benchmark tiles are in place).

Computes the same function as :func:`~.w4a8_gluon_persistent.gluon_w4a8_persistent_gemm`,
``bf16(float32(q_x[m] . q_w[n]) * s_w[n] * s_x[m] (+ t @ U.T) (+ b))``, with the same calling convention and
checks. The schedule (device code and its description in :mod:`.w4a8_gluon_pingpong_kernels`): one program per SM, a
program of two consumer warpgroups, each with its own accumulator, TMA ring and output tile, taking the program's
tiles in turn; their main loops alternate (a pair of mbarriers passes the turn), so one runs its epilogue (scaling,
low-rank term, bias, store) while the other runs its main loop. There is no loader warp: each warpgroup refills the
slot its previous MMA has released (see the kernels module for why).

A tile ``[block_w outputs, block_t tokens]`` belongs to one warpgroup: at most 128 int32 accumulator registers and
two ``A`` operands of at most 16 registers per thread (larger ones make ``ptxas`` serialise the
``wgmma``s: 128 x 128 x 128 does). ``N`` must be a multiple of 8 (TMA row pitch of the output).

Example (CUDA, sm_90)::

    out = gluon_w4a8_pingpong_gemm(q, scale, weight, t, bias)   # weight: SVDQuantWeight, group_size 0
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Final

import torch

from worldfoundry.core.acceleration.kernels.w4a8_gluon_gemm import MAX_BOX, require_hopper, tma_descriptor
from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import TileShape, check_persistent_operands
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight
from worldfoundry.errors import QuantizationInputError

#: Threads of one consumer warpgroup, which holds a whole tile.
WARPGROUP_THREADS: Final = 128
#: int32 accumulator registers per consumer thread above which the tile is refused.
MAX_ACC_REGISTERS: Final = 128
#: Registers of one unpacked ``A`` operand (one K step) per consumer thread above which the tile is refused.
MAX_OPERAND_REGISTERS: Final = 16


@dataclass(frozen=True)
class PingPongTile(TileShape):
    """One launch configuration of the ping-pong W4A8 GEMM (a tile is ``[block_w outputs, block_t tokens]``).

    Attributes:
        block_w: outputs per tile (64 or 128: one warpgroup of four warps, 16 rows each per ``wgmma``).
        block_t: tokens per tile (the ``wgmma`` width: a multiple of 16 in [32, 256]).
        block_k: input features per K step (64, 128 or 256); ``K`` must be a multiple.
        stages: slots of each consumer's TMA ring (2 to 8; ``stages - 1`` K steps are loaded ahead).
        group_t: token bands sharing one output band in the tile order.
        unpack: INT4 unpacking (0 plain int8 ops, 1 PTX nibble ops on four bytes at once).
        turns: the two consumers' main loops take turns (``True``, the ping-pong schedule) or run at the same time
            on their own tiles (``False``). The turns cover the INT4 unpacking too, which runs on the CUDA cores
            beside each ``wgmma``: with them only one warpgroup unpacks at a time, and the kernel measured 2.2x
            slower than the persistent one on the H200; without them both unpack and multiply concurrently, as the
            persistent kernel's two warpgroups do, and an epilogue still overlaps the other consumer's main loop.
    """

    block_w: int = 128
    block_t: int = 128
    block_k: int = 64
    stages: int = 6
    group_t: int = 2
    unpack: int = 1
    turns: bool = True

    def __post_init__(self) -> None:
        bad = _tile_problem(self)
        if bad:
            raise QuantizationInputError(f"PingPongTile: {bad} ({self})")

    def smem_bytes(self, int4: bool = True, rank: int = 0) -> int:
        """Shared memory the kernel allocates (a ring and an output tile per consumer, barriers)."""
        w_k = self.block_k // 2 if int4 else self.block_k
        ring = self.stages * (self.block_t * self.block_k + self.block_w * w_k)
        return 2 * (ring + 2 * self.block_t * self.block_w + 8 * self.stages) + 16



def _tile_problem(tile: PingPongTile) -> str:
    """What is wrong with ``tile`` (empty when nothing)."""
    if tile.block_w not in (64, 128) or tile.block_k not in (64, 128, 256):
        return "block_w must be 64 or 128 and block_k 64, 128 or 256"
    if not 32 <= tile.block_t <= MAX_BOX or tile.block_t % 16:
        return "block_t must be a multiple of 16 in [32, 256]"
    if not 2 <= tile.stages <= 8 or tile.group_t < 1 or tile.unpack not in (0, 1):
        return "stages must be 2..8, group_t >= 1, unpack 0 or 1"
    if not isinstance(tile.turns, bool):
        return "turns must be True or False"
    if tile.block_w * tile.block_t > MAX_ACC_REGISTERS * WARPGROUP_THREADS:
        return f"block_w * block_t is over {MAX_ACC_REGISTERS} accumulator registers per thread of one warpgroup"
    if tile.block_w * tile.block_k > 4 * MAX_OPERAND_REGISTERS * WARPGROUP_THREADS:
        return f"block_w * block_k is over {MAX_OPERAND_REGISTERS} operand registers per thread of one warpgroup"
    return ""


#: Default: the per-warpgroup tile with the least shared-memory traffic per MAC (``wgmma`` reads of the activation
#: tile plus TMA writes) among those within the register limits. Chosen offline; not yet timed on a GPU.
DEFAULT_PINGPONG_TILE: Final = PingPongTile()


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _launch(operands: tuple[Any, ...], out: torch.Tensor, tile: PingPongTile, dims: tuple[int, ...]) -> None:
    from worldfoundry.core.acceleration.kernels.w4a8_gluon_pingpong_kernels import (
        CONSUMER_REGISTERS,
        w4a8_pingpong_kernel,
    )

    q, scale, packed, w_scale, t, lora_up, bias = operands
    m, n, k, rank = dims
    x_desc = tma_descriptor(q, [tile.block_t, tile.block_k])
    w_desc = tma_descriptor(packed, [tile.block_w, tile.block_k // 2])
    out_desc = tma_descriptor(out, [tile.block_t, tile.block_w])
    chunk = tile.lowrank_chunk(rank) if rank else 0
    t_desc = tma_descriptor(t, [tile.block_t, chunk]) if rank else None
    u_desc = tma_descriptor(lora_up, [tile.block_w, chunk]) if rank else None
    tiles = -(-m // tile.block_t) * -(-n // tile.block_w)
    sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    grid = (min(-(-tiles // 2), sms),)  # each program needs two tiles to keep both consumers busy
    w4a8_pingpong_kernel[grid](
        x_desc, w_desc, scale, w_scale, t_desc, u_desc, bias, out_desc, m, n, k,
        W_SCALE_MUL=0.0625, LR_STEPS=rank // chunk if rank else 0, HAS_BIAS=bias is not None, STAGES=tile.stages,
        GROUP_T=tile.group_t, INSTR_N=tile.instr_n(), UNPACK=tile.unpack, TAKE_TURNS=tile.turns,
        CONSUMER_REGS=CONSUMER_REGISTERS, num_warps=4)


def check_pingpong_operands(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None,
                            bias: torch.Tensor | None, tile: PingPongTile) -> tuple[int, int, int, int]:
    """``(M, N, K, rank)`` after the checks of :func:`.check_persistent_operands` (no GPU needed).

    Raises:
        QuantizationInputError: grouped scales, ``N`` not a multiple of 8, too much shared memory for ``tile``, or an
            operand of the wrong dtype/shape/device.
    """
    if not isinstance(tile, PingPongTile):
        raise QuantizationInputError(
            f"gluon_w4a8_pingpong_gemm: tile must be a PingPongTile, got {type(tile).__name__}")
    try:
        return check_persistent_operands(q, scale, weight, t, bias, tile)  # type: ignore[arg-type]
    except QuantizationInputError as e:
        raise QuantizationInputError(str(e).replace("gluon_w4a8_persistent_gemm", "gluon_w4a8_pingpong_gemm")) from e


def gluon_w4a8_pingpong_gemm(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight,
                             t: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                             tile: PingPongTile | None = None) -> torch.Tensor:
    """The per-channel SVDQuant W4A8 GEMM with two ping-pong consumer warpgroups (measured slower than the
    persistent kernel).

    Args:
        q: int8 ``[M, K]`` activation codes; scale: float32 ``[M, 1]``.
        weight: per-output-channel weight (``group_size`` 0) on the same device; ``lora_up`` is used when ``t`` is set.
        t: bfloat16 ``[M, r]`` = ``x @ D.T`` for the low-rank branch, else ``None``.
        bias: optional ``[N]``.
        tile: launch configuration (default :data:`DEFAULT_PINGPONG_TILE`).

    Returns:
        bfloat16 ``[M, N]``.

    Raises:
        QuantizationInputError: see :func:`check_pingpong_operands`; or no Hopper GPU / Gluon.
    """
    tile = tile or DEFAULT_PINGPONG_TILE
    dims = check_pingpong_operands(q, scale, weight, t, bias, tile)
    require_hopper(q.device)
    out = torch.empty((dims[0], dims[1]), dtype=torch.bfloat16, device=q.device)
    if dims[0]:
        lora_up = weight.lora_up if dims[3] else None
        _launch((q, scale, weight.qweight, weight.scales, t, lora_up, bias), out, tile, dims)
    return out


__all__ = ["DEFAULT_PINGPONG_TILE", "MAX_ACC_REGISTERS", "MAX_OPERAND_REGISTERS", "PingPongTile",
           "check_pingpong_operands", "gluon_w4a8_pingpong_gemm"]
