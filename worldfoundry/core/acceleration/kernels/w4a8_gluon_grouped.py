"""Persistent W4A8 GEMM on Hopper (Gluon) with INT8 activation scales per token and group of input features, host
side.

Computes ``bf16(s_w[n] * sum_g float32(q_x[m, g] . q_w[n, g]) * s_x[m, g] (+ t @ U.T) (+ b))`` for per-channel
INT4 weights and activation codes from
:func:`~worldfoundry.core.acceleration.quantization.int8_activation.quantize_rows_int8_grouped` (or the one-read
Triton quantizer), groups of 64, 128 or 256 input features. The device code and its schedule are in
:mod:`.w4a8_gluon_grouped_kernels`: the persistent kernel's ring and register-operand INT4 unpacking, with two int32
accumulators taking the groups in turn so that each group's scaling runs on the CUDA cores while the next group's
``wgmma`` run.

Numerics: the integer sum of each group is exact and its float32 scaling and summation follow
:func:`~worldfoundry.core.acceleration.quantization.svdquant_numerics.int4_gemm_reference_grouped`, so without the
low-rank term and bias the output is bitwise ``bf16`` of that reference; with them, within the tolerance stated for
:mod:`.w4a8_gluon_gemm` (bfloat16 ``wgmma`` accumulated in float32).

The scales are read transposed, ``[G, M]`` with rows 16-byte aligned: the loader copies one row segment per K step
into the ring. :func:`~.int8_grouped_quant_lowrank.triton_quantize_rows_int8_grouped_lowrank` with
``transposed_scales=True`` writes them that way (its ``scale`` is then a ``[M, G]`` view with strides ``(1, P)``);
other scales are copied into that layout first (one small extra kernel).

Example (CUDA, sm_90)::

    q, scale, t = triton_quantize_rows_int8_grouped_lowrank(x, inv, down, 128, transposed_scales=True)
    out = gluon_w4a8_grouped_gemm(q, scale, weight, t, bias)   # weight: SVDQuantWeight, group_size 0
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Final

import torch

from worldfoundry.core.acceleration.kernels.w4a8_gluon_gemm import check_gluon_operands, require_hopper, tma_descriptor
from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import TileShape, _sm_count
from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import _tile_problem as persistent_tile_problem
from worldfoundry.core.acceleration.quantization.int4_packing import PER_CHANNEL
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight
from worldfoundry.errors import QuantizationInputError

#: Activation groups the kernel takes: a whole number of K steps, and ``16 * 8 * 127 * group < 2**22`` (a group's
#: integer sum must fit the float bias trick of :mod:`.w4a8_gluon_grouped_kernels`).
GLUON_ACT_GROUPS: Final = (64, 128, 256)
#: Registers per consumer thread the three accumulators may take.
MAX_ACC_REGISTERS: Final = 192
#: Scale rows are padded to a multiple of this many tokens (16-byte TMA row pitch).
SCALE_ROW_MULTIPLE: Final = 4


@dataclass(frozen=True)
class GroupedTile(TileShape):
    """One launch configuration of the grouped W4A8 GEMM (a tile is ``[block_w outputs, block_t tokens]``).

    Attributes:
        block_w: outputs per tile (64, 128 or 256; at least 16 per consumer warp).
        block_t: tokens per tile (the ``wgmma`` width: a multiple of 16 in [32, 256]).
        block_k: input features per K step (64, 128 or 256); the activation group must be a multiple.
        stages: slots of the TMA ring (2 to 8); warps: consumer warps, 4 or 8.
        group_t: token bands sharing one output band in the tile order.
        unpack: INT4 unpacking (0 plain int8 ops, 1 PTX nibble ops on four bytes at once).
        exact: each group's ``float(P) * s_x`` rounds before it is added (the reference's order: the output without
            low-rank term and bias is bitwise the reference's), or multiply and add round once (an FMA: one float
            operation less per element and group; the sum then differs from the reference's by float32 roundings).
    """

    block_w: int = 128
    block_t: int = 128
    block_k: int = 64
    stages: int = 6
    warps: int = 8
    group_t: int = 8
    unpack: int = 1
    exact: bool = True

    def __post_init__(self) -> None:
        bad = _tile_problem(self)
        if bad:
            raise QuantizationInputError(f"GroupedTile: {bad} ({self})")

    def smem_bytes(self, int4: bool = True, rank: int = 0) -> int:
        """Shared memory the kernel allocates (ring with scale rows, output tile, barriers)."""
        w_k = self.block_k // 2 if int4 else self.block_k
        ring = self.stages * (self.block_t * self.block_k + self.block_w * w_k + 4 * self.block_t)
        return ring + 2 * self.block_t * self.block_w + 16 * self.stages


def _tile_problem(tile: GroupedTile) -> str:
    """What is wrong with ``tile`` (empty when nothing): the persistent kernel's limits, then three accumulators."""
    bad = persistent_tile_problem(tile)  # type: ignore[arg-type]
    if bad:
        return bad
    if not isinstance(tile.exact, bool):
        return "exact must be True or False"
    if 3 * tile.block_w * tile.block_t > MAX_ACC_REGISTERS * 32 * tile.warps:
        return f"three accumulators of block_w * block_t are over {MAX_ACC_REGISTERS} registers per thread"
    return ""


#: Default: three 64-register accumulators per thread of two consumer warpgroups, six ring slots.
DEFAULT_GROUPED_TILE: Final = GroupedTile()


@functools.lru_cache(maxsize=1)
def _scale_layout() -> Any:
    """Shared layout of a scale-row segment: plain rows (no swizzle), read back in the accumulator's columns."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def transposed_scales(scale: torch.Tensor) -> torch.Tensor:
    """``scale [M, G]`` as the ``[G, M]`` view the kernel reads (16-byte aligned, row pitch a multiple of
    :data:`SCALE_ROW_MULTIPLE` tokens): the tensor itself when it already is one, else a padded copy."""
    m, groups = scale.shape
    pitch = scale.stride(1)
    if scale.stride(0) == 1 and pitch >= m and pitch % SCALE_ROW_MULTIPLE == 0 and scale.data_ptr() % 16 == 0:
        return scale.t()
    padded = -(-max(m, 1) // SCALE_ROW_MULTIPLE) * SCALE_ROW_MULTIPLE
    rows = torch.zeros((groups, padded), dtype=torch.float32, device=scale.device)
    rows[:, :m] = scale.t()
    return rows[:, :m]


def _launch(operands: tuple[Any, ...], out: torch.Tensor, tile: GroupedTile, dims: tuple[int, ...],
            group: int) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from worldfoundry.core.acceleration.kernels.w4a8_gluon_grouped_kernels import (
        GROUPED_LOADER_REGISTERS,
        w4a8_grouped_kernel,
    )

    q, scale, packed, w_scale, t, lora_up, bias = operands
    m, n, k, rank = dims
    x_desc = tma_descriptor(q, [tile.block_t, tile.block_k])
    w_desc = tma_descriptor(packed, [tile.block_w, tile.block_k // 2])
    s_desc = TensorDescriptor.from_tensor(transposed_scales(scale), [1, tile.block_t], _scale_layout())
    out_desc = tma_descriptor(out, [tile.block_t, tile.block_w])
    chunk = tile.lowrank_chunk(rank) if rank else 0
    t_desc = tma_descriptor(t, [tile.block_t, chunk]) if rank else None
    u_desc = tma_descriptor(lora_up, [tile.block_w, chunk]) if rank else None
    tiles = -(-m // tile.block_t) * -(-n // tile.block_w)
    grid = (min(tiles, _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())),)
    w4a8_grouped_kernel[grid](
        x_desc, w_desc, s_desc, w_scale, t_desc, u_desc, bias, out_desc, m, n, k,
        W_SCALE_MUL=0.0625, LR_STEPS=rank // chunk if rank else 0, HAS_BIAS=bias is not None, STAGES=tile.stages,
        GROUP_T=tile.group_t, INSTR_N=tile.instr_n(), UNPACK=tile.unpack, GROUP_STEPS=group // tile.block_k,
        EXACT=tile.exact, LOADER_REGS=GROUPED_LOADER_REGISTERS, num_warps=tile.warps,
        enable_fp_fusion=False)  # each group's product rounds before the sum (the reference's order)


def check_grouped_operands(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None,
                           bias: torch.Tensor | None, tile: GroupedTile) -> tuple[int, int, int, int, int]:
    """``(M, N, K, rank, group)`` after the operand checks of :func:`.check_gluon_operands` (no GPU needed).

    Raises:
        QuantizationInputError: group-wise weights, scales that are not float32 ``[M, K / group]`` with ``group``
            in :data:`GLUON_ACT_GROUPS` and a multiple of ``tile.block_k``, ``N`` not a multiple of 8, or an
            operand of the wrong dtype/shape/device.
    """
    what = "gluon_w4a8_grouped_gemm"
    if not isinstance(tile, GroupedTile):
        raise QuantizationInputError(f"{what}: tile must be a GroupedTile, got {type(tile).__name__}")
    if not isinstance(weight, SVDQuantWeight) or weight.group_size != PER_CHANNEL:
        got = weight.group_size if isinstance(weight, SVDQuantWeight) else type(weight).__name__
        raise QuantizationInputError(f"{what}: group_size {got} is not 0 (per channel); use triton_w4a8_gemm")
    k = weight.in_features
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.dim() != 2 \
            or not scale.shape[1] or k % scale.shape[1]:
        raise QuantizationInputError(f"{what}: scale must be float32 [M, K / group], got "
                                     f"{getattr(scale, 'dtype', type(scale).__name__)} "
                                     f"{tuple(getattr(scale, 'shape', ()))}")
    group = k // scale.shape[1]
    if group not in GLUON_ACT_GROUPS or group % tile.block_k:
        raise QuantizationInputError(f"{what}: activation groups of {group} input features; the kernel takes "
                                     f"{' / '.join(map(str, GLUON_ACT_GROUPS))} that are multiples of block_k "
                                     f"{tile.block_k}")
    lora_up = weight.lora_up if t is not None else None
    per_token = torch.empty((scale.shape[0], 1), dtype=torch.float32, device=scale.device)  # [M] is checked
    m, n, k, rank = check_gluon_operands(q, per_token, weight.qweight, weight.scales, t, lora_up, bias, int4=True,
                                         tile=tile)
    if scale.device != q.device:
        raise QuantizationInputError(f"{what}: scale on {scale.device}, codes on {q.device}")
    if n % 8:
        raise QuantizationInputError(f"{what}: N = {n} must be a multiple of 8 (TMA store)")
    return m, n, k, rank, group


def gluon_w4a8_grouped_gemm(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight,
                            t: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                            tile: GroupedTile | None = None) -> torch.Tensor:
    """The per-channel SVDQuant W4A8 GEMM with activation scales per token and group of input features.

    Args:
        q: int8 ``[M, K]`` activation codes; scale: float32 ``[M, K / group]`` (any strides; a ``[G, M]``
            transposed buffer with a 16-byte aligned row pitch is read in place).
        weight: per-output-channel weight (``group_size`` 0) on the same device; ``lora_up`` is used when ``t`` is set.
        t: bfloat16 ``[M, r]`` = ``x @ D.T`` for the low-rank branch, else ``None``.
        bias: optional ``[N]``.
        tile: launch configuration (default :data:`DEFAULT_GROUPED_TILE`).

    Returns:
        bfloat16 ``[M, N]``.

    Raises:
        QuantizationInputError: see :func:`check_grouped_operands`; or no Hopper GPU / Gluon.
    """
    tile = tile or DEFAULT_GROUPED_TILE
    m, n, k, rank, group = check_grouped_operands(q, scale, weight, t, bias, tile)
    require_hopper(q.device)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=q.device)
    if m:
        lora_up = weight.lora_up if rank else None
        _launch((q, scale, weight.qweight, weight.scales, t, lora_up, bias), out, tile, (m, n, k, rank), group)
    return out


__all__ = ["DEFAULT_GROUPED_TILE", "GLUON_ACT_GROUPS", "GroupedTile", "MAX_ACC_REGISTERS", "SCALE_ROW_MULTIPLE",
           "check_grouped_operands", "gluon_w4a8_grouped_gemm", "transposed_scales"]
