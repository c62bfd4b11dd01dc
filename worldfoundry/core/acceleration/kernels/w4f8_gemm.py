"""The W4F8 GEMM (Triton, FP8 tensor cores): INT4 residual codes widened to FP8 e4m3, FP8 activation codes.

``out = s_x[m] * (Σ_g s_w[g, n] * Σ_{k∈g} q_x[m, k] * c_R[n, k]) + t @ U.T + b`` -- the SVDQuant Linear with
per-token FP8 e4m3 activations (:func:`~worldfoundry.core.acceleration.quantization.fp8.quantize_rowwise_fp8` of
the smoothed rows) instead of INT8 ones. Every INT4 code ``-8..7`` is an FP8 e4m3 value, so widening the codes is
exact; FP8 ``wgmma`` multiplies them exactly and accumulates in float32. On sm_90 Triton pipelines FP8 dots
(its INT8 dots wait after every step, :mod:`.w4a8_channel_gemm`), which is why this path exists.

Two ways to feed the weights:

* **expanded** (default): :func:`expand_int4_to_fp8` writes the codes as an FP8 ``[N, K]`` tensor once per call
  (one pass over ``N * K / 2`` bytes; the transient tensor is freed after the call, the resident weight stays
  INT4), and the main loop loads FP8 tiles of both operands -- a plain pipelined FP8 GEMM;
* **in registers** (``expanded=False``): the main loop loads packed bytes and unpacks them in registers.

Scales: per output channel (``group_size`` 0) one float32 accumulation over the whole ``K`` and the weight scale
in the epilogue; per group (64 or 128, ``BLOCK_K`` = the group) each step's dot is scaled and added to the float32
accumulator. The epilogue (``s_x``, the fused low-rank up projection ``t @ U.T``, bias, cast) is the W4A8 one
(:mod:`.w4a8_tiles`).

Accumulation: Triton's default for FP8 dots on sm_90 keeps the partial sums in the tensor cores' reduced-precision
accumulator for the whole loop (as cuBLAS ``use_fast_accum``); ``precise_every=n`` moves them to a float32 register
every ``n`` products of ``K`` instead (Triton's ``max_num_imprecise_acc``).

:func:`triton_codes_lowrank` is the low-rank down projection computed from the FP8 codes
(``t = s_x[m] * (q_x @ D̂.T)``, ``D̂ = D * λ``) for a producer that writes only codes (the fused GELU quantizer).

Example (CPU, with ``TRITON_INTERPRET=1`` set before triton is imported)::

    wf = expand_int4_to_fp8(weight)          # float8_e4m3fn [N, K], the codes themselves
    y = triton_w4f8_gemm(q, scale, weight, t, bias, expanded=wf)
"""

from __future__ import annotations

from typing import Any, Final

import torch

from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.core.acceleration.kernels.w4a8_gemm import check_lowrank_operand
from worldfoundry.core.acceleration.kernels.w4a8_tiles import grid_for, split_launch_options
from worldfoundry.core.acceleration.kernels.w4a8_tuning import choose_config, chosen_config
from worldfoundry.core.acceleration.quantization.fp8 import FP8_DTYPE
from worldfoundry.core.acceleration.quantization.int4_packing import PER_CHANNEL, k_multiple
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight
from worldfoundry.errors import QuantizationInputError

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from worldfoundry.core.acceleration.kernels.w4a8_tiles import (
        _high_nibble,
        _low_nibble,
        _tile,
        _w4a8_epilogue,
        _widen,
    )

    @triton.jit
    def _codes_k_order(p, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PAIRED: tl.constexpr):
        """``[ROWS, BLOCK_K / 2]`` packed bytes -> ``[ROWS, BLOCK_K]`` FP8 codes in K order (exact widening).

        Paired (per channel): byte ``j`` holds ``(2j, 2j + 1)``; grouped (``BLOCK_K`` = the group): ``(j, G/2 + j)``.
        """
        lo = _low_nibble(p).to(tl.float16)
        hi = _high_nibble(p).to(tl.float16)
        if PAIRED:
            both = tl.join(lo, hi)
        else:
            both = tl.permute(tl.join(lo, hi), (0, 2, 1))
        return tl.reshape(both, [ROWS, BLOCK_K]).to(tl.float8e4nv)

    @triton.jit
    def _expand_kernel(wq_ptr, out_ptr, N, K, PAIRED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        KH: tl.constexpr = BLOCK_K // 2
        kb = pid_k * KH + tl.arange(0, KH)
        p = tl.load(wq_ptr + rows.to(tl.int64)[:, None] * (K // 2) + kb[None, :], mask=rmask[:, None], other=0)
        codes = _codes_k_order(p, BLOCK_N, BLOCK_K, PAIRED)
        kf = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + kf[None, :], codes, mask=rmask[:, None])

    @triton.jit
    def _w4f8_kernel(xq_ptr, xs_ptr, wf_ptr, wq_ptr, ws_ptr, t_ptr, lu_ptr, b_ptr, out_ptr, M, N, K,
                     RANK: tl.constexpr, HAS_LR: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
                     EXPANDED: tl.constexpr, PAIRED: tl.constexpr, PRECISE_EVERY: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     WIDEN: tl.constexpr):
        offs_m, offs_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        mmask = offs_m < M
        nmask = offs_n < N
        kf = tl.arange(0, BLOCK_K)
        KH: tl.constexpr = BLOCK_K // 2
        kb = tl.arange(0, KH)
        x_rows = offs_m.to(tl.int64) * K
        w_rows = offs_n.to(tl.int64) * K
        p_rows = offs_n.to(tl.int64) * (K // 2)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for step in range(0, K // BLOCK_K):
            k0 = step * BLOCK_K
            x = tl.load(xq_ptr + x_rows[:, None] + (k0 + kf)[None, :], mask=mmask[:, None], other=0.0)
            if EXPANDED:
                w = tl.load(wf_ptr + w_rows[None, :] + (k0 + kf)[:, None], mask=nmask[None, :], other=0.0)
            else:
                p = tl.load(wq_ptr + p_rows[:, None] + (step * KH + kb)[None, :], mask=nmask[:, None], other=0)
                w = tl.trans(_codes_k_order(p, BLOCK_N, BLOCK_K, PAIRED))
            if GROUPED:
                s = tl.load(ws_ptr + step * N + offs_n, mask=nmask, other=0.0).to(tl.float32)
                acc += tl.dot(x, w, max_num_imprecise_acc=PRECISE_EVERY) * s[None, :]
            else:
                acc = tl.dot(x, w, acc, max_num_imprecise_acc=PRECISE_EVERY)
        if not GROUPED:
            acc = acc * tl.load(ws_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        _w4a8_epilogue(acc, offs_m, offs_n, xs_ptr, t_ptr, lu_ptr, b_ptr, out_ptr, M, N, RANK, HAS_LR, HAS_BIAS,
                       False, WIDEN)

    @triton.jit
    def codes_down_projection(q_ptr, rows, rmask, stride_q, d_ptr, K, RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_K: tl.constexpr, WIDEN: tl.constexpr):
        """``float32 [BLOCK_M, RANK]`` = ``q[rows] @ D̂.T``: FP8 codes (row stride ``stride_q``) widened to bfloat16,
        ``D̂`` bfloat16 ``[RANK, K]``, one ``tl.dot`` per ``BLOCK_K`` columns."""
        r = tl.arange(0, RANK)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + kk
            cmask = cols < K
            x = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :],
                        mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.bfloat16)
            d = tl.load(d_ptr + r[None, :] * K + cols[:, None], mask=cmask[:, None], other=0.0)
            acc = tl.dot(_widen(x, WIDEN), _widen(d, WIDEN), acc)
        return acc

    @triton.jit
    def _codes_lowrank_kernel(q_ptr, s_ptr, d_ptr, t_ptr, M, K, stride_q, RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_K: tl.constexpr, WIDEN: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        r = tl.arange(0, RANK)
        acc = codes_down_projection(q_ptr, rows, rmask, stride_q, d_ptr, K, RANK, BLOCK_M, BLOCK_K, WIDEN)
        acc = acc * tl.load(s_ptr + rows, mask=rmask, other=0.0)[:, None]
        tl.store(t_ptr + rows.to(tl.int64)[:, None] * RANK + r[None, :], acc.to(tl.bfloat16), mask=rmask[:, None])


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int = 8) -> dict[str, Any]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "num_warps": warps,
            "num_stages": stages}


#: Tiles timed on CUDA (:mod:`.w4a8_tuning`) for per-channel weights: ``(BLOCK_M tokens, BLOCK_N, BLOCK_K, warps,
#: stages)``, the usual FP8 GEMM tiles of sm_90.
W4F8_CONFIGS: Final = [
    _cfg(128, 256, 128, 8, 3), _cfg(128, 256, 128, 8, 4), _cfg(256, 128, 128, 8, 3), _cfg(128, 128, 128, 8, 4),
    _cfg(128, 128, 128, 4, 4), _cfg(128, 128, 256, 8, 3), _cfg(64, 256, 128, 4, 4), _cfg(128, 64, 128, 4, 5),
]
#: Tile under the Triton interpreter (CPU tests); ``BLOCK_K`` is set to the group for grouped weights.
W4F8_INTERPRETER_CONFIG: Final = _cfg(32, 32, 128, 4, 1, 2)
#: Expansion tile (``BLOCK_K`` is the group for grouped weights, 128 per channel).
EXPAND_BLOCK_N: Final = 64


def _block_k(weight: SVDQuantWeight) -> int:
    return k_multiple(weight.group_size)


def configs_for(weight: SVDQuantWeight) -> list[dict[str, Any]]:
    """:data:`W4F8_CONFIGS` usable for ``weight``: per channel every tile whose ``BLOCK_K`` divides ``K``; grouped
    weights use ``BLOCK_K`` = the group."""
    k = weight.in_features
    if weight.group_size == PER_CHANNEL:
        return [dict(c) for c in W4F8_CONFIGS if k % c["BLOCK_K"] == 0]
    seen, out = set(), []
    for c in W4F8_CONFIGS:
        cfg = dict(c, BLOCK_K=weight.group_size)
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


def _check_triton(x: torch.Tensor, name: str) -> None:
    if not TRITON_AVAILABLE:
        raise QuantizationInputError("triton is not importable; use the torch reference")
    if x.device.type != "cuda" and not interpreter_enabled():
        raise QuantizationInputError(f"{name}: tensor on {x.device}; needs CUDA (or TRITON_INTERPRET=1 for tests)")


def expand_int4_to_fp8(weight: SVDQuantWeight) -> torch.Tensor:
    """The residual's INT4 codes as FP8 e4m3 ``[N, K]`` in K order (exact: every code is an e4m3 value).

    Raises:
        QuantizationInputError: triton missing or the weight on the CPU without the interpreter.
    """
    _check_triton(weight.qweight, "expand_int4_to_fp8")
    n, k = weight.out_features, weight.in_features
    out = torch.empty((n, k), dtype=FP8_DTYPE, device=weight.device)
    block_k = _block_k(weight)
    grid = (triton.cdiv(n, EXPAND_BLOCK_N), k // block_k)
    _expand_kernel[grid](weight.qweight, out, n, k, PAIRED=weight.group_size == PER_CHANNEL,
                         BLOCK_N=EXPAND_BLOCK_N, BLOCK_K=block_k, num_warps=4)
    return out


def _operands(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None) -> tuple[int, bool]:
    m, k = q.shape
    if q.dtype != FP8_DTYPE or k != weight.in_features or not q.is_contiguous():
        raise QuantizationInputError(f"triton_w4f8_gemm: q must be contiguous float8_e4m3fn [M, {weight.in_features}]")
    if scale.shape != (m, 1) or scale.dtype != torch.float32:
        raise QuantizationInputError(f"triton_w4f8_gemm: scale must be float32 [{m}, 1]")
    return check_lowrank_operand(weight, t, m)


def w4f8_launcher(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None,
                  bias: torch.Tensor | None, out: torch.Tensor, expanded: torch.Tensor | None,
                  precise_every: int | None = None) -> Any:
    """A function ``launch(config)`` that runs the W4F8 GEMM into ``out`` with one tile (tuning and benchmarks)."""
    m, k = q.shape
    n = weight.out_features
    rank, has_lr = _operands(q, scale, weight, t)
    if expanded is not None and (expanded.shape != (n, k) or expanded.dtype != FP8_DTYPE):
        raise QuantizationInputError(f"triton_w4f8_gemm: expanded weight must be float8_e4m3fn [{n}, {k}]")
    dummy = scale
    args = (q, scale, expanded if expanded is not None else q, weight.qweight, weight.scales,
            t if has_lr else dummy, weight.lora_up if has_lr else dummy, bias if bias is not None else dummy, out,
            m, n, k)
    flags = dict(RANK=rank, HAS_LR=has_lr, HAS_BIAS=bias is not None, GROUPED=weight.group_size != PER_CHANNEL,
                 EXPANDED=expanded is not None, PAIRED=weight.group_size == PER_CHANNEL, PRECISE_EVERY=precise_every,
                 WIDEN=q.device.type != "cuda")

    def launch(config: dict[str, Any]) -> None:
        cfg, warps, stages = split_launch_options(config)
        if weight.group_size != PER_CHANNEL:
            cfg["BLOCK_K"] = weight.group_size
        if k % cfg["BLOCK_K"]:
            raise QuantizationInputError(f"triton_w4f8_gemm: in_features {k} is not a multiple of BLOCK_K "
                                         f"{cfg['BLOCK_K']}")
        _w4f8_kernel[grid_for(m, n, cfg)](*args, **flags, **cfg, num_warps=warps, num_stages=stages)

    return launch


def triton_w4f8_gemm(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None,
                     bias: torch.Tensor | None, *, expanded: torch.Tensor | bool = True,
                     out_dtype: torch.dtype = torch.bfloat16, config: dict[str, Any] | None = None,
                     precise_every: int | None = None) -> torch.Tensor:
    """The W4F8 GEMM with the fused low-rank up projection and bias.

    Args:
        q: float8_e4m3fn ``[M, K]`` contiguous activation codes; ``scale``: float32 ``[M, 1]``.
        weight: on the same device, rank padded (:func:`~worldfoundry.core.acceleration.kernels.svdquant_dispatch.pad_rank`).
        t: bfloat16 ``[M, r]`` low-rank down projection or ``None`` for rank 0.
        bias: optional ``[N]``.
        expanded: ``True`` expands the codes to FP8 for this call (:func:`expand_int4_to_fp8`), a tensor is such an
            expansion, ``False`` unpacks in registers.
        out_dtype: output dtype.
        config: fixed tile; ``None`` chooses per shape on CUDA (:mod:`.w4a8_tuning`), the interpreter tile on the CPU.
        precise_every: see the module docstring (``None``: Triton's default).

    Returns:
        ``[M, N]`` of ``out_dtype``.

    Raises:
        QuantizationInputError: triton missing, operands of the wrong shape/dtype, or ``K`` not a multiple of the
            tile's ``BLOCK_K``.
    """
    _check_triton(q, "triton_w4f8_gemm")
    m = q.shape[0]
    out = torch.empty((m, weight.out_features), dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    wf = expand_int4_to_fp8(weight) if expanded is True else (expanded if isinstance(expanded, torch.Tensor) else None)
    launch = w4f8_launcher(q, scale, weight, t, bias, out, wf, precise_every)
    if config is None:
        if interpreter_enabled() or q.device.type != "cuda":
            config = dict(W4F8_INTERPRETER_CONFIG)
        else:
            key = ("w4f8", weight.group_size, weight.out_features, weight.in_features, t is not None, bias is not None,
                   wf is not None, precise_every)
            config = chosen_config(q.device, key, m) or choose_config(key, q.device, m, configs_for(weight), launch)
    launch(config)
    return out


def lowrank_down_for_codes(weight: SVDQuantWeight) -> torch.Tensor | None:
    """``D̂ = D * λ`` (bfloat16 ``[r, K]``): the down projection applied to smoothed codes, ``None`` for rank 0."""
    if weight.lora_down is None:
        return None
    if weight.inv_smooth is None:
        return weight.lora_down.to(torch.bfloat16).contiguous()
    return (weight.lora_down.float() / weight.inv_smooth.float()[None, :]).to(torch.bfloat16).contiguous()


def triton_codes_lowrank(q: torch.Tensor, scale: torch.Tensor, down_hat: torch.Tensor, *, block_m: int = 64,
                         block_k: int = 128, num_warps: int = 4) -> torch.Tensor:
    """``t = s_x[m] * (float(q) @ D̂.T)`` as bfloat16 ``[M, r]`` from FP8 codes (:func:`lowrank_down_for_codes`);
    ``q`` may be a column slice of a wider buffer (unit column stride).

    Raises:
        QuantizationInputError: triton missing or mismatched operands.
    """
    _check_triton(q, "triton_codes_lowrank")
    m, k = q.shape
    rank = down_hat.shape[0]
    if q.dtype != FP8_DTYPE or q.stride(1) != 1 or down_hat.shape != (rank, k) or scale.shape != (m, 1):
        raise QuantizationInputError(f"triton_codes_lowrank: q float8 [M, {k}], D̂ [{rank}, {k}], scale [M, 1]")
    t = torch.empty((m, rank), dtype=torch.bfloat16, device=q.device)
    if m:
        if interpreter_enabled():
            block_m, block_k = 16, 32
        _codes_lowrank_kernel[(triton.cdiv(m, block_m),)](q, scale, down_hat, t, m, k, q.stride(0), RANK=rank,
                                                          BLOCK_M=block_m, BLOCK_K=block_k,
                                                          WIDEN=q.device.type != "cuda", num_warps=num_warps)
    return t


__all__ = ["W4F8_CONFIGS", "W4F8_INTERPRETER_CONFIG", "configs_for", "expand_int4_to_fp8", "lowrank_down_for_codes",
           "triton_codes_lowrank", "triton_w4f8_gemm", "w4f8_launcher"]
