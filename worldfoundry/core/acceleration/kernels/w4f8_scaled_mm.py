"""The per-channel W4F8 Linear on cuBLAS: one ``torch._scaled_mm`` over the residual codes and the low-rank branch.

For a per-output-channel residual (``group_size`` 0) the SVDQuant Linear is

.. code-block:: text

    out[m, n] = s_x[m] * s_w[n] * Σ_k q_x[m, k] * c_R[n, k]  +  Σ_r t[m, r] * U[n, r]  +  b[n]

with ``q_x`` the FP8 codes of ``x / λ``, ``c_R`` the INT4 codes and ``t = x @ D.T``. Both sums fit one row-wise
scaled FP8 GEMM when the low-rank branch is appended to the reduction dimension::

    A = [q_x | a],   a[m, r] = t[m, r] / (s_x[m] * α_r)          (M, K + ...)
    B = [c_R | u],   u[n, r] = U[n, r] * α_r / s_w[n]            (N, K + ...)
    out = torch._scaled_mm(A, B.T, scale_a=s_x, scale_b=s_w, bias=b)

``α_r = ||D̂_r||_1`` keeps ``a`` inside FP8's range: ``|t[m, r]| <= 448 * s_x[m] * ||D̂_r||_1`` (``D̂ = D * λ``
acts on the smoothed rows, whose maximum ``s_x`` maps to 448). ``u`` can then exceed 448; an output channel whose
``max_r |u[n, r]|`` does so gets an exponent ``e_n`` (at most :data:`MAX_EXPONENT`): its residual codes are
stored as ``c * 2**-e_n`` (exact in e4m3, down to the subnormal grid ``2**-9``), its ``u`` divided by ``2**e_n``
and its scale multiplied by ``2**e_n`` (:func:`prepare_scaled_mm`; a weight that needs more is refused with the
reason).

One FP8 e4m3 code per low-rank term would keep 3 mantissa bits (a low-rank branch 11.6 % off on random weights,
where it carries 70 % of the output). So both appended operands are split into a head and a tail code and the
three products that matter are appended -- ``3 r`` columns::

    A[:, K:] = [a_h | a_t | a_h / 16],   a_h = fp8(a),  a_t = fp8(a - a_h)
    B[:, K:] = [u_h | u_h | u_t],        u_h = fp8(u),  u_t = fp8(16 * (u - u_h))

(``(a - a_h) * (u - u_h)`` is dropped, about ``2**-8`` of the branch). The weight side is stored as ``[u_h | u_t]``
(``2 r`` FP8 columns: the bytes of the bfloat16 ``U`` it replaces) and the head copied twice per call. On random
weights the branch is then 0.11 % off the bfloat16 one.

The codes ``c_R`` are widened to FP8 for every call (:func:`weight_operand`: one table lookup per packed byte, 2
bytes written, in the launch that copies the appended codes); the resident weight stays INT4 (``B`` is a
transient of ``N * (K + 3 r)`` bytes). The appended activation codes come from the row codes themselves
(:func:`activation_operand`: ``a = (q_x @ D̂.T) / α``, so the low-rank branch sees the same FP8 activations as
the residual, and no bfloat16 ``x @ D.T`` is formed).

Example (CUDA)::

    prep = prepare_scaled_mm(weight)                 # once per Linear
    y = scaled_mm_w4f8(x, weight, prep, bias)        # per call
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Final

import torch

from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import launch_rowwise_fp8
from worldfoundry.core.acceleration.kernels.fp8_smoothed_quant import triton_quantize_smoothed_fp8
from worldfoundry.core.acceleration.kernels.w4f8_activation_codes import DEFAULT_TILE, quantize_with_appended_codes
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.core.acceleration.quantization.fp8 import FP8_DTYPE, FP8_E4M3_MAX
from worldfoundry.core.acceleration.quantization.int4_packing import PER_CHANNEL
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight
from worldfoundry.errors import QuantizationInputError

#: ``torch._scaled_mm`` needs ``K + 3 r`` and ``N`` to be multiples of this.
ALIGN: Final = 16
#: Largest per-channel exponent: ``c * 2**-9`` is still exact in e4m3 (its subnormal grid).
MAX_EXPONENT: Final = 9

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from worldfoundry.core.acceleration.kernels.w4f8_activation_codes import store_appended_codes
    from worldfoundry.core.acceleration.kernels.w4f8_gemm import codes_down_projection

    @triton.jit
    def _expand_lut_kernel(wq_ptr, exp_ptr, lut_ptr, up_ptr, out_ptr, N, KH, RH, stride_out, BLOCK_N: tl.constexpr,
                           BLOCK_J: tl.constexpr):
        """Pair column ``j < KH`` of row ``n``: packed byte ``j`` -> the two FP8 codes ``c * 2**-e_n`` at ``2j, 2j + 1``
        (one int16 store); the next ``3 RH`` pairs: ``[u_h | u_h | u_t]`` copied from ``[u_h | u_t]`` (``RH = r / 2``
        int16 pairs per block)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        rmask = rows < N
        rows64 = rows.to(tl.int64)
        codes = rmask[:, None] & (cols < KH)[None, :]
        local = cols - KH
        extra = rmask[:, None] & (local >= 0)[None, :] & (local < 3 * RH)[None, :]
        src = tl.where(local >= 2 * RH, local - RH, local % RH)  # blocks 0, 1 -> u_h; block 2 -> u_t
        p = tl.load(wq_ptr + rows64[:, None] * KH + cols[None, :], mask=codes, other=0)
        e = tl.load(exp_ptr + rows, mask=rmask, other=0)
        pair = tl.load(lut_ptr + e[:, None] * 256 + (p.to(tl.int32) & 0xFF), mask=codes, other=0)
        up = tl.load(up_ptr + rows64[:, None] * (2 * RH) + src[None, :], mask=extra, other=0)
        tl.store(out_ptr + rows64[:, None] * stride_out + cols[None, :], tl.where(codes, pair, up), mask=codes | extra)

    @triton.jit
    def _appended_codes_kernel(a_ptr, d_ptr, alpha_ptr, M, K, stride_a, RANK: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_K: tl.constexpr, WIDEN: tl.constexpr):
        """``a = (q_x @ D̂.T) / α`` from the row codes in ``A[:, :K]`` (``s_x`` cancels), written as
        ``[a_h | a_t | a_h / 16]`` into ``A[:, K:K + 3r]``."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        acc = codes_down_projection(a_ptr, rows, rmask, stride_a, d_ptr, K, RANK, BLOCK_M, BLOCK_K, WIDEN)
        store_appended_codes(a_ptr, rows.to(tl.int64), rmask, stride_a, K, acc, alpha_ptr, RANK)


@dataclass(frozen=True)
class ScaledMMWeight:
    """What :func:`scaled_mm_w4f8` needs beside the :class:`SVDQuantWeight` (built once per Linear).

    Attributes:
        scale_b: float32 ``[1, N]`` = the residual's per-channel scales times ``2**e_n``.
        exponents: int32 ``[N]``, the ``e_n``.
        alpha: float32 ``[r]`` (``None`` for rank 0).
        down_hat: bfloat16 ``[r, K]`` = ``D * λ``, the down projection of the smoothed codes (``None`` for rank 0).
        up_codes: FP8 ``[N, 2 r]`` = ``[u_h | u_t]`` of ``u = U * α / (s_w * 2**e_n)`` (``None`` for rank 0).
    """

    scale_b: torch.Tensor
    exponents: torch.Tensor
    alpha: torch.Tensor | None
    up_codes: torch.Tensor | None
    down_hat: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return 0 if self.alpha is None else int(self.alpha.numel())

    @property
    def nbytes(self) -> int:
        """Device bytes of the prepared tensors."""
        tensors = (self.scale_b, self.exponents, self.alpha, self.up_codes, self.down_hat)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def extra(self) -> int:
        """Columns appended to ``K`` (``3 r``)."""
        return 3 * self.rank


def unsupported_reason(weight: SVDQuantWeight) -> str | None:
    """Why ``weight`` cannot run on :func:`scaled_mm_w4f8` (``None`` when it can)."""
    if weight.group_size != PER_CHANNEL:
        return f"group_size {weight.group_size}: the cuBLAS W4F8 path needs per-channel scales (group_size 0)"
    extra = 0 if weight.lora_down is None else 3 * weight.lora_down.shape[0]
    if (weight.in_features + extra) % ALIGN or weight.out_features % ALIGN:
        return f"in_features + 3 * rank ({weight.in_features} + {extra}) and out_features must be multiples of {ALIGN}"
    return None


def prepare_scaled_mm(weight: SVDQuantWeight) -> ScaledMMWeight:
    """The scales, ``α`` and appended weight codes of ``weight`` (see the module docstring).

    Raises:
        QuantizationInputError: :func:`unsupported_reason`, or no ``α_r`` keeps both appended operands in range.
    """
    reason = unsupported_reason(weight)
    if reason is not None:
        raise QuantizationInputError(f"svdquant W4F8 (cuBLAS): {reason}")
    scale = weight.scales.float().reshape(1, -1)
    if weight.lora_down is None or weight.lora_up is None:
        zeros = torch.zeros(weight.out_features, dtype=torch.int32, device=weight.device)
        return ScaledMMWeight(scale.contiguous(), zeros, None, None)
    down = weight.lora_down.float()
    if weight.inv_smooth is not None:
        down = down / weight.inv_smooth.float()[None, :]
    alpha = down.abs().sum(dim=1).clamp_min(1e-30).contiguous()                      # ||D̂_r||_1
    u = weight.lora_up.float() * alpha[None, :] / scale.t()
    need = torch.ceil(torch.log2(u.abs().amax(dim=1).clamp_min(1e-30) / FP8_E4M3_MAX)).clamp_min(0)
    if float(need.max()) > MAX_EXPONENT:
        worst = int(need.argmax())
        raise QuantizationInputError(f"svdquant W4F8 (cuBLAS): output channel {worst}'s low-rank factors need a "
                                     f"scale 2**{int(need.max())} beyond 2**{MAX_EXPONENT}; use the Triton W4F8 or "
                                     "W4A8 kernels")
    step = torch.exp2(need)
    u = (u / step[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    head = u.to(FP8_DTYPE)
    tail = ((u - head.float()) * 16.0).to(FP8_DTYPE)
    up_codes = torch.cat([head, tail], dim=1).contiguous()
    return ScaledMMWeight((scale * step[None, :]).contiguous(), need.to(torch.int32).contiguous(), alpha, up_codes,
                          down.to(torch.bfloat16).contiguous())


@functools.lru_cache(maxsize=8)
def _pair_table(device: torch.device) -> torch.Tensor:
    """int16 ``[MAX_EXPONENT + 1, 256]``: (exponent, packed byte) -> its two codes ``c * 2**-e`` as FP8 bytes (low
    nibble in the low byte)."""
    b = torch.arange(256, dtype=torch.int32)
    lo = (((b & 0xF) ^ 8) - 8).float()
    hi = (((b >> 4) ^ 8) - 8).float()
    rows = []
    for e in range(MAX_EXPONENT + 1):
        lo8 = (lo * 2.0**-e).to(FP8_DTYPE).view(torch.uint8).to(torch.int32)
        hi8 = (hi * 2.0**-e).to(FP8_DTYPE).view(torch.uint8).to(torch.int32)
        rows.append(((hi8 << 8) | lo8).to(torch.int16))
    return torch.stack(rows).contiguous().to(device)


def weight_operand(weight: SVDQuantWeight, prep: ScaledMMWeight, *, block_n: int = 32,
                   block_j: int = 256) -> torch.Tensor:
    """``B = [c_R * 2**-e | u_h | u_h | u_t]`` as FP8 ``[N, K + 3 r]``: a transient built for one call, in one
    launch (the codes widened by table lookup, the appended codes copied)."""
    n, k = weight.out_features, weight.in_features
    out = torch.empty((n, k + prep.extra), dtype=FP8_DTYPE, device=weight.device)
    kh, rh = k // 2, prep.rank // 2
    up = prep.up_codes.view(torch.int16) if prep.rank else out.view(torch.int16)
    grid = (triton.cdiv(n, block_n), triton.cdiv(kh + 3 * rh, block_j))
    _expand_lut_kernel[grid](weight.qweight, prep.exponents, _pair_table(out.device), up, out.view(torch.int16), n,
                             kh, rh, (k + prep.extra) // 2, BLOCK_N=block_n, BLOCK_J=block_j, num_warps=4)
    return out


def activation_operand(x2d: torch.Tensor, weight: SVDQuantWeight, prep: ScaledMMWeight, *, block_m: int = 64,
                       block_k: int = 128, held_smoothing: bool = True, one_launch: bool = False,
                       one_launch_tile: tuple[int, int, int] | None = None,
                       **quant: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A = [q_x | a_h | a_t | a_h / 16], s_x)``: FP8 codes of ``x / λ`` (two launches: the quantizer, then the
    appended low-rank codes computed from those codes, ``a = (q_x @ D̂.T) / α``).

    ``quant`` goes to the quantizer (e.g. ``activation`` and ``constants`` for a fused GELU producer, whose input
    ``x2d`` is then the pre-activation). With smoothing the quantizer is
    :func:`~worldfoundry.core.acceleration.kernels.fp8_smoothed_quant.triton_quantize_smoothed_fp8` (the vector
    held in registers; ``held_smoothing=False``: the rowwise kernel, same bytes). ``one_launch`` (rank > 0):
    codes and appended codes in one launch
    (:func:`~worldfoundry.core.acceleration.kernels.w4f8_activation_codes.quantize_with_appended_codes`, tile
    ``one_launch_tile``), the same codes and scales.
    """
    m, k = x2d.shape
    a = torch.empty((m, k + prep.extra), dtype=FP8_DTYPE, device=x2d.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x2d.device)
    if one_launch and prep.rank:
        tile = one_launch_tile or DEFAULT_TILE
        quantize_with_appended_codes(x2d, prep.down_hat, prep.alpha, a, scale, inv_smooth=weight.inv_smooth,
                                     tile=tile, **quant)
        return a, scale
    if weight.inv_smooth is not None and held_smoothing:
        triton_quantize_smoothed_fp8(x2d, weight.inv_smooth, q_out=a, scale_out=scale, **quant)
    else:
        launch_rowwise_fp8(x2d, inv_smooth=weight.inv_smooth, q_out=a, scale_out=scale, **quant)
    if prep.rank and m:
        if interpreter_enabled():
            block_m, block_k = 16, 32
        _appended_codes_kernel[(triton.cdiv(m, block_m),)](a, prep.down_hat, prep.alpha, m, k, a.stride(0),
                                                           RANK=prep.rank, BLOCK_M=block_m, BLOCK_K=block_k,
                                                           WIDEN=a.device.type != "cuda", num_warps=4)
    return a, scale


def scaled_mm_w4f8(x2d: torch.Tensor, weight: SVDQuantWeight, prep: ScaledMMWeight, bias: torch.Tensor | None,
                   *, use_fast_accum: bool = True,
                   activation_operand_pair: tuple[torch.Tensor, torch.Tensor] | None = None,
                   one_launch: bool = False) -> torch.Tensor:
    """The per-channel W4F8 Linear ``[M, K] -> [M, N]`` (bfloat16 out) on ``torch._scaled_mm``.

    Args:
        x2d: ``[M, K]`` activations (unit stride along K), or ignored when ``activation_operand_pair`` is given.
        weight, prep: the decomposed weight and :func:`prepare_scaled_mm`'s result.
        bias: optional ``[N]`` (bfloat16 is fused into the GEMM).
        use_fast_accum: ``torch._scaled_mm``'s fast accumulation.
        activation_operand_pair: a precomputed :func:`activation_operand` (fused producers).
        one_launch: build the activation operand in one launch (:func:`activation_operand`).
    """
    a, scale = activation_operand_pair or activation_operand(x2d, weight, prep, one_launch=one_launch)
    b = weight_operand(weight, prep)
    fused_bias = bias if bias is not None and bias.dtype == torch.bfloat16 else None
    out = torch._scaled_mm(a, b.t(), scale_a=scale, scale_b=prep.scale_b, bias=fused_bias,
                           out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)
    if bias is not None and fused_bias is None:
        out = (out.float() + bias.float()).to(torch.bfloat16)
    return out


__all__ = ["ALIGN", "MAX_EXPONENT", "ScaledMMWeight", "activation_operand", "prepare_scaled_mm",
           "scaled_mm_w4f8", "unsupported_reason", "weight_operand"]
