"""SVDQuant GEMMs (Triton): W4A8 on INT8 tensor cores (Hopper) and W4A16 for other GPUs, low-rank branch fused.

**W4A8** (:func:`triton_w4a8_gemm`): ``out = s_x * Σ_g s_w[g] * (q_x[g] · q_R[g]) + t @ U.T + b``.

* ``q_x`` int8 ``[M, K]`` and ``s_x`` float32 ``[M, 1]`` come from the per-token quantizer
  (:mod:`.int8_act_quant`); ``q_R`` is the packed INT4 residual (``int8 [N, K/2]``, layout in
  :mod:`worldfoundry.core.acceleration.quantization.int4_packing`), unpacked in registers to *16 times* the
  codes, ``lo16 = b << 4`` and ``hi16 = b & 0xF0`` (int8, each nibble moved to the high half of its byte), on
  CUDA with one 32-bit ``shl``/``and`` per four bytes (inline PTX); the 1/16 goes into the group scale (exact);
* one K step is one scale group ``G`` (64 or 128): two ``tl.dot`` int8 x int8 -> int32 (the two half-groups
  of the packing), then ``acc += float32(part) * s_w[g] / 16`` in float32, the int32 -> float32 step done
  exactly by adding the bits of ``1.5 * 2**23`` and subtracting that float (``|part| < 2**22``), which avoids
  the quarter-rate ``cvt.rn.f32.s32`` on every accumulator element and group. Group scales along K forbid one int32
  accumulation over the whole K; accumulating each group exactly and scaling in float32 keeps the group scales
  (better INT4 accuracy) at the cost of one convert + FMA per accumulator element and group;
* epilogue: ``acc * s_x``, the low-rank up projection ``tl.dot(t, U.T)`` on the same tile (``t = x @ D.T``,
  ``[M, r]`` bfloat16, computed beforehand by one small bfloat16 GEMM), bias, cast to the output dtype.

``SWAP_AB`` computes the transposed tile (weights as the left operand, which Hopper's ``wgmma`` may take from
registers); :mod:`.w4a8_tuning` picks the tile per shape (a table measured on the H200, else interleaved timing).

**Per output channel** (``group_size = 0``): :mod:`.w4a8_channel_gemm` -- one int32 accumulation over the whole K
and the scales once in the epilogue, no float work in the main loop.

**W4A16** (:func:`triton_w4a16_gemm`): ``bf16(x / λ)`` times the residual dequantized in registers
(``bf16(code * s_w)``), bfloat16 tensor cores with float32 accumulation, same epilogue.

The torch references are :func:`~worldfoundry.core.acceleration.quantization.svdquant_numerics.w4a8_linear_reference`
and ``w4a16_linear_reference``. Under the Triton interpreter (CPU tests) bfloat16 dot operands are widened to
float32 first (``WIDEN``; exact), because the interpreter multiplies bfloat16 wrongly. Integer partial sums are exact in both, so outputs differ only by float32
summation order of the low-rank dot and the final rounding (tests state the tolerance).
"""

from __future__ import annotations

from typing import Any, Final

import torch

from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.core.acceleration.kernels.w4a8_channel_gemm import (
    CHANNEL_INTERPRETER_CONFIG,
    channel_candidates,
    check_channel_k,
    launch_channel_gemm,
)
from worldfoundry.core.acceleration.kernels.w4a8_tiles import grid_for, split_launch_options
from worldfoundry.core.acceleration.kernels.w4a8_tuning import choose_config, chosen_config, measured_config
from worldfoundry.core.acceleration.quantization.int4_packing import PER_CHANNEL, SCALE_GROUPINGS, k_multiple
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight
from worldfoundry.errors import QuantizationInputError

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

#: Tile used under the Triton interpreter (CPU tests).
INTERPRETER_CONFIG: Final = {"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 2}

if TRITON_AVAILABLE:

    from worldfoundry.core.acceleration.kernels.w4a8_tiles import (
        _high_nibble,
        _high_nibble_x16,
        _low_nibble,
        _low_nibble_x16,
        _tile,
        _w4a8_epilogue,
        _widen,
    )

    @triton.jit
    def _exact_float(i):
        """float32 of int32 ``i`` for ``|i| < 2**22`` without a conversion instruction (exact).

        ``bits(1.5 * 2**23) + i`` is the float ``1.5 * 2**23 + i``; subtracting ``1.5 * 2**23`` leaves ``i``. One
        integer add and one float add instead of ``cvt.rn.f32.s32`` (a quarter-rate instruction on Hopper).
        """
        return (i + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0

    @triton.jit
    def _w4a8_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, t_ptr, lu_ptr, b_ptr, out_ptr, M, N, K,
                     GROUP: tl.constexpr, RANK: tl.constexpr, HAS_LR: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                     WIDEN: tl.constexpr, ASM: tl.constexpr = False, ACT_GROUPS: tl.constexpr = 0):
        offs_m, offs_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        mmask = offs_m < M
        nmask = offs_n < N
        HALF: tl.constexpr = GROUP // 2
        kh = tl.arange(0, HALF)
        x_rows = offs_m.to(tl.int64) * K
        w_rows = offs_n.to(tl.int64) * (K // 2)
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(0, K // GROUP):
            k0 = g * GROUP
            # codes enter the dot times 16 (nibble kept in the high half of each byte): the scale takes the
            # 1/16 (exact, a power of two); |16 * partial| <= 16 * 128 * 127 * 8 < 2**22 for _exact_float
            s = tl.load(ws_ptr + g * N + offs_n, mask=nmask, other=0.0).to(tl.float32) * 0.0625
            if SWAP_AB:
                p = tl.load(wq_ptr + w_rows[:, None] + (g * HALF + kh)[None, :], mask=nmask[:, None], other=0)
                xa = tl.load(xq_ptr + x_rows[None, :] + (k0 + kh)[:, None], mask=mmask[None, :], other=0)
                xb = tl.load(xq_ptr + x_rows[None, :] + (k0 + HALF + kh)[:, None], mask=mmask[None, :], other=0)
                part = tl.dot(_low_nibble_x16(p, ASM), xa, out_dtype=tl.int32)
                part = tl.dot(_high_nibble_x16(p, ASM), xb, part, out_dtype=tl.int32)
                if ACT_GROUPS:  # (part * s_x[m, g]) * s_w[g, n], the reference's order
                    sx = tl.load(xs_ptr + offs_m.to(tl.int64) * ACT_GROUPS + g, mask=mmask, other=0.0)
                    acc += (_exact_float(part) * sx[None, :]) * s[:, None]
                else:
                    acc += _exact_float(part) * s[:, None]
            else:
                p = tl.load(wq_ptr + w_rows[None, :] + (g * HALF + kh)[:, None], mask=nmask[None, :], other=0)
                xa = tl.load(xq_ptr + x_rows[:, None] + (k0 + kh)[None, :], mask=mmask[:, None], other=0)
                xb = tl.load(xq_ptr + x_rows[:, None] + (k0 + HALF + kh)[None, :], mask=mmask[:, None], other=0)
                part = tl.dot(xa, _low_nibble_x16(p, ASM), out_dtype=tl.int32)
                part = tl.dot(xb, _high_nibble_x16(p, ASM), part, out_dtype=tl.int32)
                if ACT_GROUPS:
                    sx = tl.load(xs_ptr + offs_m.to(tl.int64) * ACT_GROUPS + g, mask=mmask, other=0.0)
                    acc += (_exact_float(part) * sx[:, None]) * s[None, :]
                else:
                    acc += _exact_float(part) * s[None, :]
        _w4a8_epilogue(acc, offs_m, offs_n, xs_ptr, t_ptr, lu_ptr, b_ptr, out_ptr, M, N, RANK, HAS_LR, HAS_BIAS,
                       SWAP_AB, WIDEN, ACT_GROUPS == 0)

    @triton.jit
    def _w4a16_kernel(x_ptr, inv_ptr, wq_ptr, ws_ptr, t_ptr, lu_ptr, b_ptr, out_ptr, M, N, K, stride_xm,
                      GROUP: tl.constexpr, RANK: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_LR: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                      WIDEN: tl.constexpr, PAIRED: tl.constexpr = False):
        offs_m, offs_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        mmask = offs_m < M
        nmask = offs_n < N
        HALF: tl.constexpr = GROUP // 2
        kh = tl.arange(0, HALF)
        x_rows = offs_m.to(tl.int64) * stride_xm
        w_rows = offs_n.to(tl.int64) * (K // 2)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(0, K // GROUP):
            k0 = g * GROUP
            # grouped codes: byte j = (k0 + j, k0 + HALF + j); per channel (PAIRED): (k0 + 2j, k0 + 2j + 1)
            ka = k0 + kh * 2 if PAIRED else k0 + kh
            kb = ka + 1 if PAIRED else ka + HALF
            s = tl.load(ws_ptr + (0 if PAIRED else g * N) + offs_n, mask=nmask, other=0.0).to(tl.float32)
            p = tl.load(wq_ptr + w_rows[None, :] + (g * HALF + kh)[:, None], mask=nmask[None, :], other=0)
            xa = tl.load(x_ptr + x_rows[:, None] + ka[None, :], mask=mmask[:, None], other=0.0).to(tl.float32)
            xb = tl.load(x_ptr + x_rows[:, None] + kb[None, :], mask=mmask[:, None], other=0.0).to(tl.float32)
            if HAS_SMOOTH:
                xa = xa * tl.load(inv_ptr + ka)[None, :]
                xb = xb * tl.load(inv_ptr + kb)[None, :]
            lo = (_low_nibble(p).to(tl.float32) * s[None, :]).to(tl.bfloat16)
            hi = (_high_nibble(p).to(tl.float32) * s[None, :]).to(tl.bfloat16)
            acc = tl.dot(_widen(xa.to(tl.bfloat16), WIDEN), _widen(lo, WIDEN), acc)
            acc = tl.dot(_widen(xb.to(tl.bfloat16), WIDEN), _widen(hi, WIDEN), acc)
        r = tl.arange(0, RANK)
        if HAS_LR:
            tt = tl.load(t_ptr + offs_m.to(tl.int64)[:, None] * RANK + r[None, :], mask=mmask[:, None], other=0.0)
            lu = tl.load(lu_ptr + offs_n.to(tl.int64)[None, :] * RANK + r[:, None], mask=nmask[None, :], other=0.0)
            acc = tl.dot(_widen(tt, WIDEN), _widen(lu, WIDEN), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])

    def _config(block_m: int, block_n: int, warps: int, stages: int, swap: bool | None = None) -> Any:
        meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "GROUP_M": 8}
        if swap is not None:
            meta["SWAP_AB"] = swap
        return {**meta, "num_warps": warps, "num_stages": stages}

    #: Candidates of the group-scale W4A8 GEMM on CUDA (chosen per shape by :mod:`.w4a8_tuning`). None spills
    #: registers on sm_90 (``ptxas -v``: 256-wide tiles spill 0.5 KB and are left out); the 4-warp tiles fit two
    #: or more programs per SM, so one program's MMAs overlap another's per-group float32 scaling.
    #: Mostly ``SWAP_AB`` tiles: there the unpacked weights stay in registers as wgmma's A operand, while the
    #: other orientation writes them back to shared memory every K step (one such tile kept for comparison).
    W4A8_CONFIGS: Final = [
        _config(128, 128, 8, 4, False), _config(128, 128, 8, 4, True), _config(128, 128, 8, 3, True),
        _config(64, 128, 4, 4, True), _config(128, 64, 4, 4, True), _config(64, 64, 4, 4, True),
    ]
    W4A16_CONFIGS: Final = [
        triton.Config({k: v for k, v in c.items() if not k.startswith("num_")}, num_warps=c["num_warps"],
                      num_stages=c["num_stages"])
        for c in (_config(128, 128, 8, 4), _config(128, 256, 8, 3), _config(256, 128, 8, 3), _config(64, 128, 4, 4))
    ]
    _w4a16_tuned = triton.autotune(configs=W4A16_CONFIGS, key=["M", "N", "K", "GROUP", "HAS_LR", "HAS_BIAS",
                                                                 "HAS_SMOOTH", "PAIRED"])(_w4a16_kernel)


def check_lowrank_operand(weight: SVDQuantWeight, t: torch.Tensor | None, m: int) -> tuple[int, bool]:
    """``(padded rank, has low-rank)`` after checking the group size and ``t`` against ``weight``.

    Raises:
        QuantizationInputError: unsupported group size, unpadded rank, or ``t`` of the wrong shape/dtype.
    """
    if weight.group_size not in SCALE_GROUPINGS:
        raise QuantizationInputError(
            f"svdquant GEMM: group_size {weight.group_size} is not 0 (per channel), 64 or 128")
    has_lr = weight.lora_up is not None
    if has_lr:
        rank = weight.lora_up.shape[1]
        if rank < 16 or rank & (rank - 1):
            raise QuantizationInputError(f"svdquant GEMM: rank {rank} must be a power of two >= 16 (use pad_rank)")
        if t is None or t.shape != (m, rank) or t.dtype != torch.bfloat16:
            raise QuantizationInputError(f"svdquant GEMM: low-rank input t must be bfloat16 [{m}, {rank}]")
        return rank, True
    return 16, False


def _launch_grouped(args: tuple[Any, ...], flags: dict[str, Any], config: dict[str, Any], m: int, n: int) -> None:
    cfg, warps, stages = split_launch_options(config)
    run_flags = dict(flags)
    if "ASM" in cfg:  # a config may pin the unpacking variant (benchmark comparison); never under the interpreter
        run_flags["ASM"] = bool(cfg.pop("ASM")) and flags["ASM"]
    _w4a8_kernel[grid_for(m, n, cfg)](*args, **run_flags, **cfg, num_warps=warps, num_stages=stages)


def tile_key(weight: SVDQuantWeight, has_lr: bool, has_bias: bool, asm: bool) -> tuple[Any, ...]:
    """Shape key of the tile choice (:mod:`.w4a8_tuning` adds the device and the ``M`` bucket)."""
    kernel = "w4a8_channel" if weight.group_size == PER_CHANNEL else "w4a8"
    return (kernel, weight.group_size, weight.out_features, weight.in_features, has_lr, has_bias, asm)


def w4a8_tile(q: torch.Tensor, weight: SVDQuantWeight, launch: Any, flags: dict[str, Any]) -> dict[str, Any]:
    """The tile :func:`triton_w4a8_gemm` runs for this call on CUDA (:mod:`.w4a8_tuning`; may time candidates)."""
    m, k = q.shape
    key = tile_key(weight, flags["HAS_LR"], flags["HAS_BIAS"], flags["ASM"]) + (("act_groups",) if
                                                                                 flags.get("ACT_GROUPS") else ())
    cached = chosen_config(q.device, key, m)
    if cached is not None:  # the common case: one dict lookup per call
        return cached
    candidates = channel_candidates(k) if weight.group_size == PER_CHANNEL else W4A8_CONFIGS
    measured = measured_config(q.device, key[0], weight.group_size, weight.out_features, k, m)
    return choose_config(key, q.device, m, candidates, launch, measured)


def triton_w4a8_gemm(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None,
                     bias: torch.Tensor | None, *, out_dtype: torch.dtype = torch.bfloat16,
                     config: dict[str, Any] | None = None) -> torch.Tensor:
    """The W4A8 GEMM with fused low-rank up projection and bias (group scales, or per channel: one int32 sum).

    Args:
        q: int8 ``[M, K]`` contiguous activation codes; ``scale``: float32 ``[M, 1]``, or with group-wise weights
            ``[M, K / group_size]``: one scale per token and weight group
            (:func:`~worldfoundry.core.acceleration.quantization.int8_activation.quantize_rows_int8_grouped`),
            applied per group in the main loop in the order of
            :func:`~worldfoundry.core.acceleration.quantization.svdquant_numerics.int4_gemm_reference_grouped`.
        weight: on the same device, rank padded (:func:`~worldfoundry.core.acceleration.kernels.svdquant_dispatch.pad_rank`);
            ``group_size`` 0 runs :mod:`.w4a8_channel_gemm`.
        t: bfloat16 ``[M, r]`` = ``x @ D.T`` or ``None`` for rank 0.
        bias: optional ``[N]``.
        out_dtype: output dtype.
        config: fixed tile (``BLOCK_M``, ``BLOCK_N``, ``GROUP_M``, ``SWAP_AB``, optional ``num_warps``,
            ``num_stages``, ``ASM`` -- ``False`` unpacks with plain int8 ops instead of 32-bit inline PTX --, and
            per channel ``BLOCK_K``, 128 or 256); ``None`` chooses per shape on CUDA (:mod:`.w4a8_tuning`) and uses the
            interpreter tile under the interpreter.

    Returns:
        ``[M, N]`` of ``out_dtype``.

    Raises:
        QuantizationInputError: triton missing or operands of the wrong shape/dtype.
    """
    if not TRITON_AVAILABLE:
        raise QuantizationInputError("triton is not importable; use the torch reference")
    m, k = q.shape
    n = weight.out_features
    if q.dtype != torch.int8 or k != weight.in_features or not q.is_contiguous():
        raise QuantizationInputError(f"triton_w4a8_gemm: q must be contiguous int8 [M, {weight.in_features}]")
    rank, has_lr = check_lowrank_operand(weight, t, m)
    channel = weight.group_size == PER_CHANNEL
    if channel:
        check_channel_k(k)
    act_groups = _activation_groups(scale, weight, m)
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    args = (q, scale, weight.qweight, weight.scales, t if has_lr else scale, weight.lora_up if has_lr else scale,
            bias if bias is not None else scale, out, m, n, k)
    flags = dict(RANK=rank, HAS_LR=has_lr, HAS_BIAS=bias is not None, WIDEN=q.device.type != "cuda",
                 ASM=q.device.type == "cuda" and not interpreter_enabled())
    flags.update({"ACT_GROUPS": act_groups} if act_groups else {})
    if not channel:
        flags["GROUP"] = weight.group_size
    launcher = launch_channel_gemm if channel else _launch_grouped

    def launch(c: dict[str, Any]) -> None:  # per channel with activation groups: one group per K step
        launcher(args, flags, dict(c, BLOCK_K=k // act_groups) if channel and act_groups else c, m, n)

    if config is None:
        if interpreter_enabled() or q.device.type != "cuda":
            config = dict(CHANNEL_INTERPRETER_CONFIG) if channel else dict(INTERPRETER_CONFIG, SWAP_AB=False)
        else:
            config = w4a8_tile(q, weight, launch, flags)
    launch(config)
    return out


#: Activation groups the per-channel GEMM takes: one K step each (its steps are 128 or 256 input features).
CHANNEL_ACT_GROUPS: Final = (128, 256)


def _activation_groups(scale: torch.Tensor, weight: SVDQuantWeight, m: int) -> int:
    """0 for per-token scales (``M`` of them); else the group count of ``[M, K / group]`` scales: with group-wise
    weights one per weight group, with per-channel weights groups of 128 or 256 input features."""
    if scale.numel() == m:
        return 0
    k = weight.in_features
    groups = scale.shape[1] if scale.dim() == 2 else 0
    if weight.group_size == PER_CHANNEL:
        fits = groups > 0 and k % groups == 0 and k // groups in CHANNEL_ACT_GROUPS
        wanted = f"groups of {' or '.join(map(str, CHANNEL_ACT_GROUPS))} input features with per-channel weights"
    else:
        fits = groups == k // weight.group_size
        wanted = f"one per token and weight group ([{m}, {k // weight.group_size}])"
    if not fits or scale.shape != (m, groups) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise QuantizationInputError(f"triton_w4a8_gemm: activation scales per group must be contiguous float32, "
                                     f"{wanted}; got {tuple(scale.shape)} for group_size {weight.group_size}")
    return groups


def triton_w4a16_gemm(x2d: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None, bias: torch.Tensor | None,
                      *, out_dtype: torch.dtype = torch.bfloat16, config: dict[str, Any] | None = None) -> torch.Tensor:
    """The W4A16 GEMM: ``bf16(x / λ) @ bf16(deq(R)).T`` + low-rank up projection + bias.

    Args:
        x2d: float ``[M, K]`` activations with unit stride along K.
        weight, t, bias, out_dtype, config: as for :func:`triton_w4a8_gemm` (per channel too).

    Returns:
        ``[M, N]`` of ``out_dtype``.
    """
    if not TRITON_AVAILABLE:
        raise QuantizationInputError("triton is not importable; use the torch reference")
    m, k = x2d.shape
    n = weight.out_features
    if k != weight.in_features or x2d.stride(-1) != 1:
        raise QuantizationInputError(f"triton_w4a16_gemm: x must be [M, {weight.in_features}] with unit K stride")
    rank, has_lr = check_lowrank_operand(weight, t, m)
    out = torch.empty((m, n), dtype=out_dtype, device=x2d.device)
    if m == 0:
        return out
    inv = weight.inv_smooth
    args = (x2d, inv if inv is not None else out, weight.qweight, weight.scales, t if has_lr else out,
            weight.lora_up if has_lr else out, bias if bias is not None else out, out, m, n, k, x2d.stride(0))
    flags = dict(GROUP=k_multiple(weight.group_size), RANK=rank, HAS_SMOOTH=inv is not None, HAS_LR=has_lr,
                 HAS_BIAS=bias is not None, WIDEN=x2d.device.type != "cuda",
                 PAIRED=weight.group_size == PER_CHANNEL)
    if config is None and not interpreter_enabled():
        _w4a16_tuned[lambda meta: grid_for(m, n, meta)](*args, **flags)
        return out
    cfg, warps, _ = split_launch_options(dict(INTERPRETER_CONFIG) if config is None else config)
    for key in ("SWAP_AB", "ASM", "BLOCK_K"):  # W4A8-only meta-parameters of a shared config
        cfg.pop(key, None)
    _w4a16_kernel[grid_for(m, n, cfg)](*args, **flags, **cfg, num_warps=warps)
    return out


__all__ = ["CHANNEL_ACT_GROUPS", "INTERPRETER_CONFIG", "W4A8_CONFIGS", "check_lowrank_operand", "tile_key", "triton_w4a16_gemm",
           "triton_w4a8_gemm", "w4a8_tile"]
