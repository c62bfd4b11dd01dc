"""Persistent, warp-specialised W4A8 GEMM on Hopper (Gluon), host side: INT4 weights as the register operand.

Computes the same function as :func:`~.w4a8_gluon_gemm.gluon_w4a8_gemm`,
``bf16(float32(q_x[m] . q_w[n]) * s_w[n] * s_x[m] (+ t @ U.T) (+ b))``, with another schedule (device code and
its description in :mod:`.w4a8_gluon_persistent_kernels`): one program per SM walking output tiles, a loader warp
filling a TMA ring, the INT4 weights unpacked into the registers of the ``wgmma`` ``A`` operand (the output is
computed transposed, ``[outputs, tokens]`` tiles, and stored through a transposed shared view), the low-rank operands
loaded into a ring slot after the last K step, and each tile's TMA store left in flight under the next tile.

Numerics: the int32 sum is exact and the scaling follows the reference's order, so without the low-rank term and
bias the output is bitwise ``bf16`` of :func:`~.w4a8_gluon_gemm.w4a8_reference`; with them, within the tolerance
stated for :mod:`.w4a8_gluon_gemm` (bfloat16 ``wgmma`` accumulated in float32).

Measured on the H200 (M = 32,760, ms, one run; ``benchmarks/results/h200-2026-12-02f``, bf16 1.22 / 1.18 in that
run): 1536 -> 8960 GEMM alone 0.96, with the rank-32 term and bias 1.06; 8960 -> 1536 0.91 and 0.86. The tensor
cores idle during each tile's epilogue (one consumer group), and two CTA barriers per K step keep both warpgroups in
lockstep.

The low-rank ``t``/``U`` columns are loaded in chunks of :meth:`PersistentTile.lowrank_chunk` columns, one ring slot
each (rank 32: one slot at ``block_k`` 128, two at 64). ``N`` must be a multiple of 8 (TMA row pitch of the output).

Example (CUDA, sm_90)::

    out = gluon_w4a8_persistent_gemm(q, scale, weight, t, bias)   # weight: SVDQuantWeight, group_size 0
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Final

import torch

from worldfoundry.core.acceleration.kernels.w4a8_gluon_gemm import (
    HOPPER_SMEM_BYTES,
    INT8_INSTR_N,
    MAX_BOX,
    check_gluon_operands,
    require_hopper,
    tma_descriptor,
)
from worldfoundry.core.acceleration.quantization.int4_packing import PER_CHANNEL
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight
from worldfoundry.errors import QuantizationInputError

#: int32 accumulator registers per consumer thread above which the tile is refused (the rest hold two operands).
MAX_ACC_REGISTERS: Final = 128


class TileShape:
    """What the W4A8 tile configurations share (their fields ``block_t`` and ``block_k``): the ``wgmma`` width, the
    low-rank chunk per ring slot, the JSON form."""

    block_t: int
    block_k: int

    def instr_n(self) -> int:
        """Widest int8 ``wgmma`` ``n`` dividing ``block_t``."""
        return next(n for n in INT8_INSTR_N if self.block_t % n == 0)

    def lowrank_chunk(self, rank: int) -> int:
        """Low-rank columns per ring slot: the widest of 64, 32, 16 dividing ``rank`` whose ``U`` tile fits the
        packed-weight buffer of one slot (``2 * chunk <= block_k / 2`` bytes per row; the ``t`` tile then fits too).
        """
        return next(c for c in (64, 32, 16) if rank % c == 0 and 4 * c <= self.block_k)

    def to_json(self) -> dict[str, int]:
        """The fields as a plain dict."""
        return asdict(self)


@dataclass(frozen=True)
class PersistentTile(TileShape):
    """One launch configuration of the persistent W4A8 GEMM (a tile is ``[block_w outputs, block_t tokens]``).

    Attributes:
        block_w: outputs per tile (64, 128 or 256; at least 16 per consumer warp).
        block_t: tokens per tile (the ``wgmma`` width: a multiple of 16 in [32, 256]).
        block_k: input features per K step (64, 128 or 256); ``K`` must be a multiple.
        stages: slots of the TMA ring (2 to 8); warps: consumer warps, 4 (one warpgroup) or 8 (two).
        group_t: token bands sharing one output band in the tile order.
        unpack: INT4 unpacking (0 plain int8 ops, 1 PTX nibble ops on four bytes at once).
    """

    block_w: int = 128
    block_t: int = 256
    block_k: int = 128
    stages: int = 4
    warps: int = 8
    group_t: int = 8
    unpack: int = 1

    def __post_init__(self) -> None:
        bad = _tile_problem(self)
        if bad:
            raise QuantizationInputError(f"PersistentTile: {bad} ({self})")

    def smem_bytes(self, int4: bool = True, rank: int = 0) -> int:
        """Shared memory the kernel allocates (ring, output tile, barriers); the low-rank tiles reuse the ring."""
        w_k = self.block_k // 2 if int4 else self.block_k
        ring = self.stages * (self.block_t * self.block_k + self.block_w * w_k)
        return ring + 2 * self.block_t * self.block_w + 16 * self.stages



def _tile_problem(tile: PersistentTile) -> str:
    """What is wrong with ``tile`` (empty when nothing)."""
    if tile.block_w not in (64, 128, 256) or tile.block_k not in (64, 128, 256):
        return "block_w and block_k must be 64, 128 or 256"
    if not 32 <= tile.block_t <= MAX_BOX or tile.block_t % 16:
        return "block_t must be a multiple of 16 in [32, 256]"
    if tile.warps not in (4, 8) or not 2 <= tile.stages <= 8 or tile.group_t < 1 or tile.unpack not in (0, 1):
        return "warps must be 4 or 8, stages 2..8, group_t >= 1, unpack 0 or 1"
    if tile.block_w < 16 * tile.warps:
        return f"block_w must give each of the {tile.warps} consumer warps 16 rows"
    if tile.block_w * tile.block_t > MAX_ACC_REGISTERS * 32 * tile.warps:
        return f"block_w * block_t is over {MAX_ACC_REGISTERS} accumulator registers per thread"
    return ""


#: Default: the fastest tile of the GEMM alone at both W81 FFN shapes in the sweep of
#: ``benchmarks/kernels/w4a8_gluon.py`` on the H200 (``benchmarks/results/h200-2026-12-02f``).
DEFAULT_PERSISTENT_TILE: Final = PersistentTile(128, 256, 64, 6, 8, group_t=2)


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _launch(operands: tuple[Any, ...], out: torch.Tensor, tile: PersistentTile, dims: tuple[int, ...],
            row_max: torch.Tensor | None = None, row_max_mode: int = 1) -> None:
    from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent_kernels import (
        LOADER_REGISTERS,
        w4a8_persistent_kernel,
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
    grid = (min(tiles, _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())),)
    w4a8_persistent_kernel[grid](
        x_desc, w_desc, scale, w_scale, t_desc, u_desc, bias, out_desc,
        row_max.view(torch.int32) if row_max is not None else scale, m, n, k,
        W_SCALE_MUL=0.0625, LR_STEPS=rank // chunk if rank else 0, HAS_BIAS=bias is not None, STAGES=tile.stages,
        GROUP_T=tile.group_t, INSTR_N=tile.instr_n(), UNPACK=tile.unpack, LOADER_REGS=LOADER_REGISTERS,
        ROW_MAX=row_max_mode if row_max is not None else 0, num_warps=tile.warps)


def check_persistent_operands(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None,
                              bias: torch.Tensor | None, tile: PersistentTile) -> tuple[int, int, int, int]:
    """``(M, N, K, rank)`` after the checks of :func:`.check_gluon_operands` and this kernel's own (no GPU needed).

    Raises:
        QuantizationInputError: grouped scales, ``N`` not a multiple of 8, or an operand of the wrong
            dtype/shape/device.
    """
    if not isinstance(weight, SVDQuantWeight) or weight.group_size != PER_CHANNEL:
        got = weight.group_size if isinstance(weight, SVDQuantWeight) else type(weight).__name__
        raise QuantizationInputError(f"gluon_w4a8_persistent_gemm: group_size {got} is not 0 (per channel); "
                                     "use triton_w4a8_gemm for group scales")
    lora_up = weight.lora_up if t is not None else None
    dims = check_gluon_operands(q, scale, weight.qweight, weight.scales, t, lora_up, bias, int4=True, tile=tile)
    if dims[1] % 8:
        raise QuantizationInputError(f"gluon_w4a8_persistent_gemm: N = {dims[1]} must be a multiple of 8 (TMA store)")
    return dims


#: Slack on the shared-memory estimate of a tile with the row-maximum epilogue: triton 3.6 allocated 1,028 bytes
#: more than :meth:`PersistentTile.smem_bytes` for the default tile (alignment), and the H200 refused the 4-stage
#: 128 x 256 x 128 tile at 4 bytes over the estimate below.
ROW_MAX_SMEM_SLACK: Final = 2048


def row_max_smem_bytes(tile: PersistentTile) -> int:
    """Shared memory the row-maximum epilogue adds, with :data:`ROW_MAX_SMEM_SLACK`: the cross-warp reduction's
    scratch, one float per token and warp."""
    return tile.block_t * tile.warps * 4 + ROW_MAX_SMEM_SLACK


def check_row_max(row_max: torch.Tensor | None, m: int, device: torch.device,
                  tile: PersistentTile | None = None) -> None:
    """A row-maximum output is float32 ``[M]``, contiguous, on the GEMM's device, and its scratch fits the tile's
    shared memory; else a typed error."""
    if row_max is None:
        return
    if tile is not None and tile.smem_bytes() + row_max_smem_bytes(tile) > HOPPER_SMEM_BYTES:
        raise QuantizationInputError(f"gluon_w4a8_persistent_gemm: row_max needs {row_max_smem_bytes(tile)} more "
                                     f"bytes of shared memory than tile {tile} leaves (limit {HOPPER_SMEM_BYTES}); "
                                     "use fewer stages")
    if not isinstance(row_max, torch.Tensor) or row_max.dtype != torch.float32 or tuple(row_max.shape) != (m,) \
            or not row_max.is_contiguous() or row_max.device != device:
        raise QuantizationInputError(f"w4a8 GEMM: row_max must be a contiguous float32 [{m}] tensor on {device} "
                                     f"(zeros, or maxima to merge with), got {getattr(row_max, 'dtype', row_max)} "
                                     f"{tuple(getattr(row_max, 'shape', ()))}")


def gluon_w4a8_persistent_gemm(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight,
                               t: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                               tile: PersistentTile | None = None, row_max: torch.Tensor | None = None,
                               row_max_staged: bool = True) -> torch.Tensor:
    """The per-channel SVDQuant W4A8 GEMM with a persistent, warp-specialised schedule.

    Args:
        q: int8 ``[M, K]`` activation codes; scale: float32 ``[M, 1]``.
        weight: per-output-channel weight (``group_size`` 0) on the same device; ``lora_up`` is used when ``t`` is set.
        t: bfloat16 ``[M, r]`` = ``x @ D.T`` for the low-rank branch, else ``None``.
        bias: optional ``[N]``.
        tile: launch configuration (default :data:`DEFAULT_PERSISTENT_TILE`).
        row_max: optional float32 ``[M]`` that receives ``max(row_max[m], max_n out[m, n], 0)`` (pass zeros for
            each row's largest output, floored at 0): the epilogue merges it in with an atomic maximum.
        row_max_staged: take the row maxima from the bfloat16 tile staged for the TMA store, one token row per
            thread while the store is in flight (the default: the same values, about a quarter of the
            instructions, no extra shared memory; H200, W81 up projection: 0.923 against 0.882 ms without row
            maxima, where ``False``, a reduction of the accumulator across lanes and warps, took 1.089 ms).

    Returns:
        bfloat16 ``[M, N]``.

    Raises:
        QuantizationInputError: see :func:`check_persistent_operands`; or no Hopper GPU / Gluon.
    """
    tile = tile or DEFAULT_PERSISTENT_TILE
    dims = check_persistent_operands(q, scale, weight, t, bias, tile)
    check_row_max(row_max, dims[0], q.device, None if row_max_staged else tile)
    require_hopper(q.device)
    out = torch.empty((dims[0], dims[1]), dtype=torch.bfloat16, device=q.device)
    if dims[0]:
        lora_up = weight.lora_up if dims[3] else None
        _launch((q, scale, weight.qweight, weight.scales, t, lora_up, bias), out, tile, dims, row_max,
                2 if row_max_staged else 1)
    return out


__all__ = ["DEFAULT_PERSISTENT_TILE", "MAX_ACC_REGISTERS", "PersistentTile", "TileShape", "check_persistent_operands",
           "check_row_max", "gluon_w4a8_persistent_gemm", "row_max_smem_bytes"]
