"""W8A8 and W4A8 GEMMs on Hopper's INT8 tensor cores with asynchronous ``wgmma`` (Gluon), host side.

``out = bf16(float32(q_x[m] . q_w[n]) * s_w[n] * s_x[m] (+ t @ U.T) (+ b))`` with ``q_x`` the int8 per-token
activation codes ``[M, K]`` (scale float32 ``[M, 1]``) and ``q_w`` either int8 codes ``[N, K]``
(:func:`gluon_w8a8_gemm`) or the per-output-channel INT4 residual of an SVDQuant weight, packed in pairs
(:func:`gluon_w4a8_gemm`; layout in :mod:`worldfoundry.core.acceleration.quantization.int4_packing`).

Why Gluon: Triton 3.6's software pipeliner makes an int8 ``tl.dot`` on sm_90 a synchronous ``wgmma`` (it waits
after every dot), so :mod:`.w4a8_channel_gemm` cannot overlap its MMAs with the next loads. Gluon states the
pipeline explicitly: a TMA ring with mbarriers and ``warpgroup_mma(..., is_async=True)`` followed by
``warpgroup_mma_wait(1)`` (device code and its description in :mod:`.w4a8_gluon_kernels`).

Numerics: the int32 accumulation is exact (``|acc| <= 16 * 8 * 128 * K < 2**31`` for ``K <= 131,072``, the INT4
codes entering as ``16 * code``, the 16 folded into the weight scale exactly), then ``float32(acc) * s_w * s_x`` in
the reference's order, so without the low-rank term and bias the output is bitwise ``bf16`` of
:func:`gemm_reference` (and, for INT4, of
:func:`~worldfoundry.core.acceleration.quantization.svdquant_numerics.int4_gemm_reference`). The low-rank term is
a bfloat16 ``wgmma`` with float32 accumulation added after the scaling, bias last: the tests state a tolerance.

Measured on the H200 (GEMM alone, M = 32,760, ms; ``benchmarks/results/h200-2026-12-02f``): 1536 -> 8960 bf16
1.16, FP8 ``_scaled_mm`` 0.66, Gluon W8A8 0.92-0.96, Gluon W4A8 1.03-1.13; 8960 -> 1536 bf16 1.12, FP8 0.64, W8A8
0.73, W4A8 0.91-0.95. What remains: the programs are not persistent (each tile's prologue and epilogue leave the
tensor cores idle unless a second program runs on the SM), the warps that issue the MMAs also unpack INT4, and
the compiler adds CTA barriers around every TMA issue.

Gluon kernels do not run under the Triton interpreter (``TRITON_INTERPRET=1``): on CPU only the argument checks
run (they raise :class:`~worldfoundry.errors.QuantizationInputError` before any kernel is touched).

Example (CUDA, sm_90)::

    out = gluon_w4a8_gemm(q, scale, weight, t, bias)          # weight: SVDQuantWeight with group_size 0
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Final

import torch

from worldfoundry.core.acceleration.kernels.int8_act_quant import interpreter_enabled
from worldfoundry.core.acceleration.kernels.w4a8_channel_gemm import MAX_CHANNEL_K
from worldfoundry.core.acceleration.kernels.w4a8_gluon_kernels import GLUON_AVAILABLE
from worldfoundry.core.acceleration.quantization.int4_packing import PER_CHANNEL, unpack_int4
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight
from worldfoundry.errors import QuantizationInputError

#: ``wgmma`` instruction widths ``n`` Triton accepts for 8-bit integer operands (largest first).
INT8_INSTR_N: Final = (224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 24, 16, 8)
#: Dynamic shared memory of one Hopper thread block (227 KB).
HOPPER_SMEM_BYTES: Final = 232448
#: Largest TMA box edge.
MAX_BOX: Final = 256
_SCALE_DTYPES: Final = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GluonTile:
    """One launch configuration of the Gluon GEMM.

    Attributes:
        block_m: tokens per tile (64, 128 or 256); block_n: outputs per tile (64 to 256, multiple of 16).
        block_k: input features per K step (64, 128 or 256); ``K`` must be a multiple.
        stages: slots of the TMA ring (2 to 6); warps: 4 (one warpgroup) or 8 (two).
        group_m: row tiles sharing one column band in the launch order.
        unpack: INT4 unpacking (0 plain int8 ops, 1 PTX nibble ops, 2 PTX nibble ops + ``prmt`` interleave).
        pack_vec: packed INT4 bytes per thread and row (8 or 16).
        epi_tma: store the output tile by TMA from shared memory (reusing the ring) instead of plain stores.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 128
    stages: int = 4
    warps: int = 8
    group_m: int = 8
    unpack: int = 2
    pack_vec: int = 8
    epi_tma: bool = True

    def __post_init__(self) -> None:
        bad = _tile_problem(self)
        if bad:
            raise QuantizationInputError(f"GluonTile: {bad} ({self})")

    def warps_mn(self) -> tuple[int, int]:
        """``warps_per_cta`` of the accumulator: M first while every warp still gets 16 rows."""
        wm, wn = 4, 1
        while wm * wn < self.warps:
            if self.block_m > 16 * wm:
                wm *= 2
            else:
                wn *= 2
        return wm, wn

    def instr_n(self) -> int:
        """Widest int8 ``wgmma`` ``n`` that divides ``block_n`` and fits one warp's share of it."""
        m_reps = -(-self.block_m // 16)
        n_reps = -(-self.warps // m_reps)
        max_n = max(self.block_n // n_reps, 8)
        return next(n for n in INT8_INSTR_N if n <= max_n and self.block_n % n == 0)

    def smem_bytes(self, int4: bool, rank: int) -> int:
        """Shared memory the kernel allocates (ring, unpacked weight buffers, low-rank tiles, barriers)."""
        w_k = self.block_k // 2 if int4 else self.block_k
        ring = self.stages * (self.block_m * self.block_k + self.block_n * w_k)
        unpacked = 2 * self.block_n * self.block_k if int4 else 0
        lowrank = 2 * rank * (self.block_m + self.block_n)
        return ring + unpacked + lowrank + 8 * (self.stages + 1)

    def to_json(self) -> dict[str, int]:
        """The fields as a plain dict."""
        return asdict(self)


def _tile_problem(tile: GluonTile) -> str:
    """What is wrong with ``tile`` (empty when nothing)."""
    if tile.block_m not in (64, 128, 256) or tile.block_k not in (64, 128, 256):
        return "block_m and block_k must be 64, 128 or 256"
    if not 16 <= tile.block_n <= MAX_BOX or tile.block_n % 16:
        return "block_n must be a multiple of 16 in [16, 256]"
    if tile.warps not in (4, 8) or not 2 <= tile.stages <= 6 or tile.group_m < 1:
        return "warps must be 4 or 8, stages 2..6, group_m >= 1"
    if tile.unpack not in (0, 1, 2) or tile.pack_vec not in (8, 16):  # (block_k / 2) / pack_vec lanes divide 32
        return "unpack must be 0, 1 or 2 and pack_vec 8 or 16"
    return ""


#: Defaults: fastest or within 5 % of it in the sweep of ``benchmarks/kernels/w4a8_gluon.py`` on the H200 at the
#: W81 FFN shapes (M = 32,760; ``benchmarks/results/h200-2026-12-02f``). 128 x 128 tiles with 8 warps use 102
#: registers and 98-107 KB of shared memory, so two programs share an SM and one's epilogue overlaps the other's MMAs.
DEFAULT_W8A8_TILE: Final = GluonTile(128, 128, 128, 3, 8)
DEFAULT_W4A8_TILE: Final = GluonTile(128, 128, 128, 3, 8)


def _check_matrix(what: str, value: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype not in dtypes:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise QuantizationInputError(f"Gluon GEMM: {what} must be a {'/'.join(map(str, dtypes))} tensor, got {got}")
    if tuple(value.shape) != shape or not value.is_contiguous():
        raise QuantizationInputError(f"Gluon GEMM: {what} must be contiguous {list(shape)}, got {list(value.shape)}"
                                     f"{'' if value.is_contiguous() else ' (not contiguous)'}")


def _check_vector(what: str, value: torch.Tensor, dtypes: tuple[torch.dtype, ...], length: int) -> None:
    """``value`` holds ``length`` contiguous elements of one of ``dtypes`` (shape ``[L]``, ``[L, 1]`` or ``[1, L]``)."""
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
    if shape not in ((length,), (length, 1), (1, length)):
        raise QuantizationInputError(f"Gluon GEMM: {what} must have shape [{length}] or [{length}, 1] / [1, {length}], "
                                     f"got {list(shape) if shape else type(value).__name__}")
    _check_matrix(what, value, dtypes, shape)


def _check_lowrank(t: torch.Tensor | None, lora_up: torch.Tensor | None, m: int, n: int) -> int:
    """The rank of ``t @ lora_up.T`` (0 without), after checking both operands."""
    if (t is None) != (lora_up is None):
        raise QuantizationInputError("Gluon GEMM: pass both t [M, r] and lora_up [N, r] for the low-rank term, "
                                     "or neither")
    if t is None or lora_up is None:
        return 0
    rank = int(lora_up.shape[-1]) if lora_up.dim() == 2 else -1
    if rank < 16 or rank % 16 or rank > MAX_BOX:
        raise QuantizationInputError(f"Gluon GEMM: rank {rank} must be a multiple of 16 in [16, 256] (use pad_rank)")
    _check_matrix("t", t, (torch.bfloat16,), (m, rank))
    _check_matrix("lora_up", lora_up, (torch.bfloat16,), (n, rank))
    return rank


def check_gluon_operands(q: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor,
                         t: torch.Tensor | None, lora_up: torch.Tensor | None, bias: torch.Tensor | None, *,
                         int4: bool, tile: GluonTile | Any) -> tuple[int, int, int, int]:
    """``(M, N, K, rank)`` after checking every operand's dtype, shape, contiguity and device (no GPU needed).

    ``tile`` is a :class:`GluonTile` or any configuration with ``block_k`` and ``smem_bytes(int4, rank)``.

    Raises:
        QuantizationInputError: naming the operand and what it must be.
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() != 2:
        raise QuantizationInputError("Gluon GEMM: q must be a 2-D int8 tensor [M, K] of activation codes")
    m, k = q.shape
    _check_matrix("q", q, (torch.int8,), (m, k))
    n = int(codes.shape[0]) if isinstance(codes, torch.Tensor) and codes.dim() == 2 else -1
    _check_matrix("packed INT4 weight" if int4 else "weight codes", codes, (torch.int8,), (n, k // 2 if int4 else k))
    if k % tile.block_k or k > MAX_CHANNEL_K:
        raise QuantizationInputError(f"Gluon GEMM: K = {k} must be a multiple of block_k {tile.block_k} and at most "
                                     f"{MAX_CHANNEL_K} (int32 accumulator)")
    _check_vector("scale", scale, (torch.float32,), m)
    _check_vector("weight scale", w_scale, _SCALE_DTYPES, n)
    if bias is not None:
        _check_matrix("bias", bias, _SCALE_DTYPES, (n,))
    rank = _check_lowrank(t, lora_up, m, n)
    devices = {x.device for x in (q, scale, codes, w_scale, t, lora_up, bias) if x is not None}
    if len(devices) != 1:
        raise QuantizationInputError(f"Gluon GEMM: all operands must be on one device, got {sorted(map(str, devices))}")
    if tile.smem_bytes(int4, rank) > HOPPER_SMEM_BYTES:
        raise QuantizationInputError(f"Gluon GEMM: {tile} needs {tile.smem_bytes(int4, rank)} bytes of shared memory "
                                     f"(limit {HOPPER_SMEM_BYTES}); use fewer stages or a smaller tile")
    return m, n, k, rank


def require_hopper(device: torch.device) -> None:
    """Raise unless Gluon is importable, the interpreter is off and ``device`` is a Hopper (sm_90) GPU."""
    if not GLUON_AVAILABLE:
        raise QuantizationInputError("Gluon GEMM: triton with triton.experimental.gluon is not importable")
    if interpreter_enabled():
        raise QuantizationInputError("Gluon GEMM: Gluon kernels do not run under TRITON_INTERPRET; use the reference")
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        raise QuantizationInputError(f"Gluon GEMM: needs a Hopper (sm_90) CUDA device, got {device}")


@functools.lru_cache(maxsize=64)
def _nvmma_layout(block: tuple[int, ...], int8: bool) -> Any:
    """The default NVMMA shared layout of a ``block`` box (an immutable value: built once per box and dtype, since
    building it took 6 us of host time, five times per GEMM call)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), gl.int8 if int8 else gl.bfloat16)


def tma_descriptor(x: torch.Tensor, block: list[int]) -> Any:
    """Host TMA descriptor of ``x`` (int8 or bfloat16) with a ``block`` box and the default NVMMA swizzle."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(x, block, _nvmma_layout(tuple(block), x.dtype == torch.int8))


def _launch(operands: tuple[Any, ...], out: torch.Tensor, tile: GluonTile, int4: bool, dims: tuple[int, ...]) -> None:
    from worldfoundry.core.acceleration.kernels.w4a8_gluon_kernels import int8_wgmma_gemm_kernel

    q, scale, codes, w_scale, t, lora_up, bias = operands
    m, n, k, rank = dims
    x_desc = tma_descriptor(q, [tile.block_m, tile.block_k])
    w_desc = tma_descriptor(codes, [tile.block_n, tile.block_k // 2 if int4 else tile.block_k])
    out_desc = tma_descriptor(out, [tile.block_m, tile.block_n]) if tile.epi_tma else None
    t_desc = tma_descriptor(t, [tile.block_m, rank]) if rank else None
    u_desc = tma_descriptor(lora_up, [tile.block_n, rank]) if rank else None
    warps_m, warps_n = tile.warps_mn()
    grid = (-(-m // tile.block_m) * -(-n // tile.block_n),)
    int8_wgmma_gemm_kernel[grid](
        x_desc, w_desc, scale, w_scale, t_desc, u_desc, bias, out, out_desc, m, n, k,
        W_SCALE_MUL=0.0625 if int4 else 1.0, INT4=int4, HAS_LR=rank > 0, HAS_BIAS=bias is not None,
        STAGES=tile.stages, GROUP_M=tile.group_m, WARPS_M=warps_m, WARPS_N=warps_n, INSTR_N=tile.instr_n(),
        UNPACK=tile.unpack, PACK_VEC=tile.pack_vec, W8_SWIZZLE=min(128, tile.block_k), EPI_TMA=tile.epi_tma,
        num_warps=tile.warps)


def _run(operands: tuple[Any, ...], tile: GluonTile, int4: bool) -> torch.Tensor:
    q, scale, codes, w_scale, t, lora_up, bias = operands
    dims = check_gluon_operands(q, scale, codes, w_scale, t, lora_up, bias, int4=int4, tile=tile)
    require_hopper(q.device)
    out = torch.empty((dims[0], dims[1]), dtype=torch.bfloat16, device=q.device)
    if dims[0]:
        _launch(operands, out, tile, int4, dims)
    return out


def gluon_w8a8_gemm(q: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor, *,
                    t: torch.Tensor | None = None, lora_up: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, tile: GluonTile | None = None) -> torch.Tensor:
    """``bf16(float32(q @ codes.T) * w_scale * scale (+ t @ lora_up.T) (+ bias))`` with int8 weight codes.

    Args:
        q: int8 ``[M, K]`` activation codes, contiguous; scale: float32 ``[M, 1]`` (or ``[M]``).
        codes: int8 ``[N, K]`` weight codes, contiguous; w_scale: ``[N]`` or ``[1, N]`` float32/bfloat16/float16.
        t, lora_up: optional bfloat16 ``[M, r]`` and ``[N, r]`` (``r`` a multiple of 16).
        bias: optional ``[N]``.
        tile: launch configuration (default :data:`DEFAULT_W8A8_TILE`).

    Returns:
        bfloat16 ``[M, N]``.

    Raises:
        QuantizationInputError: operands of the wrong dtype/shape/device, or no Hopper GPU / Gluon.
    """
    return _run((q, scale, codes, w_scale, t, lora_up, bias), tile or DEFAULT_W8A8_TILE, False)


def gluon_w4a8_gemm(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, *, tile: GluonTile | None = None) -> torch.Tensor:
    """The per-channel SVDQuant W4A8 GEMM: INT4 residual (unpacked on chip), low-rank up projection, bias.

    Args:
        q: int8 ``[M, K]`` activation codes; scale: float32 ``[M, 1]``.
        weight: per-output-channel weight (``group_size`` 0) on the same device; ``lora_up`` is used when set.
        t: bfloat16 ``[M, r]`` = ``x @ D.T`` when the weight has a low-rank branch, else ``None``.
        bias: optional ``[N]``.
        tile: launch configuration (default :data:`DEFAULT_W4A8_TILE`).

    Returns:
        bfloat16 ``[M, N]``.

    Raises:
        QuantizationInputError: grouped scales, operands of the wrong dtype/shape/device, or no Hopper GPU / Gluon.
    """
    if weight.group_size != PER_CHANNEL:
        raise QuantizationInputError(f"gluon_w4a8_gemm: group_size {weight.group_size} is not 0 (per channel); "
                                     "use triton_w4a8_gemm for group scales")
    return _run((q, scale, weight.qweight, weight.scales, t, weight.lora_up, bias), tile or DEFAULT_W4A8_TILE, True)


def gemm_reference(q: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor,
                   t: torch.Tensor | None = None, lora_up: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of the Gluon GEMMs in float32: exact integer products (float64), then the kernel's order.

    ``codes`` int8 ``[N, K]``; for a packed INT4 weight pass ``unpack_int4(qweight, 0)``.
    """
    exact = (q.double() @ codes.double().t()).float()
    out = exact * w_scale.float().reshape(1, -1) * scale.float().reshape(-1, 1)
    if t is not None and lora_up is not None:
        out = out + t.float() @ lora_up.float().t()
    if bias is not None:
        out = out + bias.float()
    return out


def w4a8_reference(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gemm_reference` of a per-channel packed INT4 weight (float32 ``[M, N]``)."""
    codes = unpack_int4(weight.qweight, PER_CHANNEL)
    return gemm_reference(q, scale, codes, weight.scales, t, weight.lora_up if t is not None else None, bias)


__all__ = ["DEFAULT_W4A8_TILE", "DEFAULT_W8A8_TILE", "GluonTile", "HOPPER_SMEM_BYTES", "INT8_INSTR_N", "MAX_BOX",
           "check_gluon_operands", "gemm_reference", "gluon_w4a8_gemm", "gluon_w8a8_gemm", "require_hopper",
           "tma_descriptor", "w4a8_reference"]
