"""SVDQuant numerics: smoothing, low-rank + INT4 residual decomposition, and the torch references of the W4A8
and W4A16 Linears.

A Linear ``y = x @ W.T + b`` (``W`` is ``[N, K]``) is rewritten with a per-input-channel smoothing factor ``λ``
(from calibration activation statistics), a rank-``r`` pair ``U [N, r]``, ``D [r, K]`` (bfloat16) and an INT4
residual ``R`` with group-wise scales:

.. code-block:: text

    Ŵ      = W * λ                          (columns scaled: the outlier channels of x move into the weight)
    Ŵ      ≈ U @ (D * λ) + R                (U, D from the SVD of Ŵ; D acts on the raw input, 1/λ folded in)
    y      ≈ s_x * Σ_g s_w[g] * (q_x[g] · q_R[g])  +  (x @ D.T) @ U.T  +  b
             └── W4A8 residual: x̂ = x / λ as per-token INT8, R as INT4 ──┘   └ low-rank, bfloat16 ┘

* smoothing (SmoothQuant's rule): ``λ_k = a_k^α / w_k^(1-α)`` with ``a_k`` the calibration absmax of input
  channel ``k`` and ``w_k = max_n |W[n, k]|``, clamped to [1e-4, 1e4];
* the SVD is exact (``torch.linalg.svd``) or randomized (``torch.svd_lowrank``, seeded) for large weights;
* ``U`` and ``D`` are rounded to bfloat16 *before* the residual is formed, so ``R`` absorbs their rounding;
* the residual is quantized with :func:`~worldfoundry.core.acceleration.quantization.int4_packing.quantize_int4_groupwise`
  (symmetric, group 64 or 128 along ``K``, or one scale per output channel -- ``group_size = 0`` -- bfloat16
  scales).

**Per output channel** (``group_size = 0``): ``y ≈ s_x[m] * s_w[n] * (q_x[m] · q_R[n]) + ...`` -- the whole ``K``
sums in one int32 accumulator (``|16 * q_x · q_R| <= 16 * 127 * 8 * K < 2**31`` for ``K <= 131,072``; the GEMM
feeds the codes times 16), converted once to float32 (round to nearest even) and scaled by ``s_w[n]`` and then
``s_x[m]`` in the epilogue. :func:`int4_gemm_reference` forms the same integer exactly (float64 matmul of
integers below 2**53), rounds it to float32 and multiplies in the same order, so the residual GEMM is bitwise
the kernel's before the low-rank and bias additions.

Group scales along ``K`` mean the INT8xINT4 products cannot be summed in one int32 accumulator across the whole
``K``: the W4A8 GEMM accumulates each group exactly in int32 (at most 127 * 8 * 128 < 2**24 in magnitude) and
adds ``float32(partial) * s_w`` in float32, group after group. :func:`w4a8_linear_reference` does the same in
the same order; integer partial sums are exact in both, so kernel and reference differ only in the
low-rank dot product's summation order and bfloat16 output rounding.

``rank = 0`` and no smoothing is plain INT4 round-to-nearest (RTN) at the same bits, the baseline SVDQuant is
compared against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

import torch

from worldfoundry.core.acceleration.quantization.int4_packing import (
    PER_CHANNEL,
    dequantize_int4_groupwise,
    quantize_int4_groupwise,
    unpack_int4,
)
from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8
from worldfoundry.core.acceleration.quantization.int8_activation import (
    quantize_rows_int8,
    quantize_rows_int8_grouped,
    smoothed_rows,
)
from worldfoundry.errors import QuantizationInputError

#: Bounds of a smoothing factor.
SMOOTH_MIN: Final = 1e-4
SMOOTH_MAX: Final = 1e4
#: Floor of the statistics the smoothing rule divides by / raises to a power.
STAT_FLOOR: Final = 1e-5
SVD_METHODS: Final = ("full", "randomized")
#: Roundings of the INT4 residual (``gptq_rounding``): to nearest, GPTQ left to right, GPTQ in act order.
ROUNDINGS: Final = ("nearest", "gptq", "gptq-ordered")
#: Dtype of the low-rank factors.
LOWRANK_DTYPE: Final = torch.bfloat16


@dataclass(frozen=True)
class SVDQuantWeight:
    """A Linear weight as low-rank branch + INT4 residual (all tensors on one device).

    Attributes:
        qweight: int8 ``[N, K/2]``, packed INT4 residual codes (layout in ``int4_packing``).
        scales: bfloat16 ``[K/G, N]`` residual scales (``[1, N]`` per channel).
        group_size: ``G`` (64 or 128), or 0 for one scale per output channel over the whole ``K``.
        inv_smooth: float32 ``[K]`` = ``1/λ`` applied to the input of the residual branch, or ``None``.
        lora_down: bfloat16 ``[r, K]`` acting on the raw input (``1/λ`` folded in), or ``None`` (rank 0).
        lora_up: bfloat16 ``[N, r]``, or ``None``.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int
    inv_smooth: torch.Tensor | None = None
    lora_down: torch.Tensor | None = None
    lora_up: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * 2

    @property
    def rank(self) -> int:
        return 0 if self.lora_down is None else int(self.lora_down.shape[0])

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by field name (absent optional ones left out)."""
        out = {"qweight": self.qweight, "scales": self.scales}
        for name in ("inv_smooth", "lora_down", "lora_up"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> SVDQuantWeight:
        """A copy on ``device`` (same dtypes)."""
        moved = {k: v.to(device) for k, v in self.tensors().items()}
        return replace(self, **moved)

    def effective_weight(self) -> torch.Tensor:
        """The dense ``[N, K]`` float32 weight this stands for: ``deq(R) / λ + U @ D``."""
        w = dequantize_int4_groupwise(self.qweight, self.scales, self.group_size)
        if self.inv_smooth is not None:
            w = w * self.inv_smooth.float()
        if self.lora_down is not None and self.lora_up is not None:
            w = w + self.lora_up.float() @ self.lora_down.float()
        return w


def smoothing_factors(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """``λ_k = a_k^α / w_k^(1-α)`` (float32 ``[K]``), clamped to [1e-4, 1e4].

    Args:
        act_absmax: float ``[K]`` calibration absmax of each input channel.
        weight: ``[N, K]`` weight.
        alpha: migration strength in [0, 1].

    Raises:
        QuantizationInputError: shapes disagree, alpha out of range or non-finite statistics.
    """
    if weight.dim() != 2 or act_absmax.shape != (weight.shape[1],):
        raise QuantizationInputError(
            f"smoothing_factors: activation statistics {tuple(act_absmax.shape)} do not match weight {tuple(weight.shape)}"
        )
    if not 0.0 <= alpha <= 1.0:
        raise QuantizationInputError(f"smoothing_factors: alpha must be in [0, 1], got {alpha}")
    a = act_absmax.detach().float().to(weight.device)
    if not bool(torch.isfinite(a).all()):
        raise QuantizationInputError("smoothing_factors: activation statistics contain NaN or Inf")
    a = a.clamp_min(STAT_FLOOR)
    w = weight.detach().float().abs().amax(dim=0).clamp_min(STAT_FLOOR)
    return (a.pow(alpha) / w.pow(1.0 - alpha)).clamp_(SMOOTH_MIN, SMOOTH_MAX)


def svd_top(matrix: torch.Tensor, rank: int, method: str, seed: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """The top ``rank`` singular triplets ``(u [N, r], s [r], vh [r, K])``: exact, or randomized (seeded)."""
    if method == "full":
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
        return u[:, :rank], s[:rank], vh[:rank]
    devices = [matrix.device] if matrix.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        u, s, v = torch.svd_lowrank(matrix, q=min(rank + 16, *matrix.shape), niter=4)
    return u[:, :rank], s[:rank], v[:, :rank].t()


def decompose(weight: torch.Tensor, *, rank: int, group_size: int, act_absmax: torch.Tensor | None = None,
              alpha: float = 0.5, svd: str = "full", seed: int = 0, hessian: torch.Tensor | None = None,
              rounding: str | None = None, lowrank_fit: str = "svd", refine: int = 0) -> SVDQuantWeight:
    """Split a Linear weight into smoothing, a bfloat16 rank-``r`` pair and an INT4 residual.

    Args:
        weight: ``[N, K]`` float weight (any device; the SVD runs there in float32).
        rank: ``r >= 0``; 0 keeps no low-rank branch.
        group_size: 64 or 128, or 0 (per output channel; ``K`` a multiple of 128).
        act_absmax: calibration absmax per input channel ``[K]``; ``None`` disables smoothing.
        alpha: smoothing migration strength.
        svd: ``"full"`` (exact) or ``"randomized"`` (``torch.svd_lowrank``, 4 power iterations, seeded).
        seed: seed of the randomized SVD.
        hessian: the calibration inputs' second moments ``X^T X`` ``[K, K]`` (taken under the smoothing).
        rounding: ``"gptq"`` (error compensation under ``hessian``,
            :mod:`~worldfoundry.core.acceleration.quantization.gptq_rounding`), ``"gptq-ordered"`` (the same in
            decreasing order of ``hessian``'s diagonal, with searched scales) or ``"nearest"``; ``None``: GPTQ
            when ``hessian`` is given. Same codes and scales format.
        lowrank_fit: ``"svd"`` (SVD of the smoothed weight) or ``"whitened"`` (the pair that least changes the
            calibration outputs, :mod:`~worldfoundry.core.acceleration.quantization.lowrank_fit`; needs ``hessian``).
        refine: alternate refitting the pair to what the codes left and requantizing, this many times, keeping
            the decomposition with the least output error (needs ``hessian`` and ``rank > 0``).

    Returns:
        :class:`SVDQuantWeight` on the weight's device. ``rank = 0`` without ``act_absmax`` is INT4 RTN.

    Raises:
        QuantizationInputError: bad shapes, rank above ``min(N, K)``, unknown ``svd``, fit or group size.
    """
    from worldfoundry.core.acceleration.quantization import lowrank_fit as fit

    _check_decompose(weight, rank, svd)
    rounding = ("gptq" if hessian is not None else "nearest") if rounding is None else rounding
    if rounding not in ROUNDINGS or (rounding != "nearest" and hessian is None):
        raise QuantizationInputError(f"decompose: rounding {rounding!r} must be one of {list(ROUNDINGS)} (gptq needs "
                                     "the inputs' second moments)")
    fit.check_fit(lowrank_fit, refine, hessian is not None, rank)
    w = weight.detach().float()
    smooth = inv_smooth = None
    if act_absmax is not None:
        smooth = smoothing_factors(act_absmax, w, alpha)
        inv_smooth = (1.0 / smooth).contiguous()
        w = w * smooth
    moments = None
    if hessian is not None:
        from worldfoundry.core.acceleration.quantization.gptq_rounding import smoothed_hessian

        moments = (hessian if smooth is None else smoothed_hessian(hessian, smooth)).to(w.device)
    down, up, qweight, scales = _fit_and_round(w, rank, group_size, smooth, moments, rounding,
                                               lowrank_fit, refine, svd, seed)
    return SVDQuantWeight(qweight, scales, group_size, inv_smooth, down, up)


def _fit_and_round(w: torch.Tensor, rank: int, group_size: int, smooth: torch.Tensor | None,
                   moments: torch.Tensor | None, rounding: str, lowrank_fit: str, refine: int, svd: str,
                   seed: int) -> tuple:
    """``(down, up, qweight, scales)`` of the smoothed weight ``w``: the first split, then ``refine`` refits of
    the pair to ``w - deq(codes)``, keeping the split with the least output error."""
    from worldfoundry.core.acceleration.quantization import lowrank_fit as fit

    whiten = fit.whitening_factor(moments) if moments is not None and (lowrank_fit == "whitened" or refine) else None
    rounding_moments = moments if rounding != "nearest" else None
    fit_whiten = whiten if lowrank_fit == "whitened" else None
    ordered = rounding == "gptq-ordered"
    parts = _split(w, w, rank, group_size, smooth, rounding_moments, fit_whiten, svd, seed, ordered)
    best = (fit.output_error(w - parts[3], whiten), parts)
    for _ in range(refine):
        target = w - dequantize_int4_groupwise(parts[0], parts[1], group_size)
        parts = _split(w, target, rank, group_size, smooth, rounding_moments, fit_whiten, svd, seed, ordered)
        error = fit.output_error(w - parts[3], whiten)
        if error < best[0]:
            best = (error, parts)
    qweight, scales, lowrank, _ = best[1]
    down, up = lowrank if lowrank is not None else (None, None)
    return down, up, qweight, scales


def _check_decompose(weight: torch.Tensor, rank: int, svd: str) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise QuantizationInputError(f"decompose: expected a 2-D float weight, got {tuple(weight.shape)}")
    n, k = weight.shape
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= min(n, k):
        raise QuantizationInputError(f"decompose: rank must be an integer in [0, {min(n, k)}], got {rank!r}")
    if svd not in SVD_METHODS:
        raise QuantizationInputError(f"decompose: svd must be one of {list(SVD_METHODS)}, got {svd!r}")


def _split(w: torch.Tensor, target: torch.Tensor, rank: int, group_size: int, smooth: torch.Tensor | None,
           moments: torch.Tensor | None, whiten: torch.Tensor | None, svd: str, seed: int,
           ordered: bool = False) -> tuple:
    """``(qweight, scales, (down, up) or None, smoothed effective weight)``: the pair fitted to ``target`` (in the
    smoothed space), rounded to bfloat16, then the INT4 residual ``w - U D`` rounded (GPTQ under ``moments``)."""
    from worldfoundry.core.acceleration.quantization.lowrank_fit import fit_lowrank

    lowrank = None
    residual = w
    if rank > 0:
        up_f, down_smoothed = fit_lowrank(target, rank, whiten=whiten, svd=svd, seed=seed)
        up = up_f.to(LOWRANK_DTYPE).contiguous()
        down = (down_smoothed if smooth is None else down_smoothed * (1.0 / smooth)).to(LOWRANK_DTYPE).contiguous()
        acting = down.float() if smooth is None else down.float() * smooth
        residual = w - up.float() @ acting
        lowrank = (down, up)
    if moments is None:
        qweight, scales = quantize_int4_groupwise(residual, group_size)
    else:
        from worldfoundry.core.acceleration.quantization.gptq_rounding import gptq_quantize_int4

        qweight, scales = gptq_quantize_int4(residual, moments, group_size, ordered=ordered)
    effective = dequantize_int4_groupwise(qweight, scales, group_size) + (w - residual)
    return qweight, scales, lowrank, effective


def weight_rel_error(weight: torch.Tensor, quantized: SVDQuantWeight) -> float:
    """``||W_eff - W|| / ||W||`` in float64 (a calibration diagnostic)."""
    ref = weight.detach().double()
    eff = quantized.effective_weight().to(ref.device).double()
    return float((eff - ref).norm() / ref.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ references


def int4_gemm_reference(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight) -> torch.Tensor:
    """``s_x[m] * Σ_g s_w[g, n] * (q_x[m, g] · q_R[n, g])`` in float32, groups summed in order.

    Integer partial sums are formed exactly (float32 matmul of integer values below 2**24 in magnitude). Per
    channel (``group_size = 0``): ``float32(q_x · q_R) * s_w[n] * s_x[m]``, the integer exact (float64 matmul).

    Returns:
        float32 ``[M, N]``.
    """
    g = weight.group_size
    if g == PER_CHANNEL:
        codes = unpack_int4(weight.qweight, g).double()
        exact = (q.double() @ codes.t()).float()
        return exact * weight.scales.float()[0] * scale.float()
    codes = unpack_int4(weight.qweight, g).float()
    qx = q.float()
    scales = weight.scales.float()
    acc = torch.zeros(q.shape[0], weight.out_features, dtype=torch.float32, device=q.device)
    for i in range(weight.in_features // g):
        part = qx[:, i * g:(i + 1) * g] @ codes[:, i * g:(i + 1) * g].t()
        acc = acc + part * scales[i]
    return acc * scale.float()


def int4_gemm_reference_grouped(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight) -> torch.Tensor:
    """The residual GEMM with activation scales per token and group of ``K / scale.shape[1]`` input channels
    (:func:`~worldfoundry.core.acceleration.quantization.int8_activation.quantize_rows_int8_grouped`): each
    sub-group common to the activation and weight groupings sums exactly as an integer, is rounded to float32 and
    scaled by its activation scale (and its weight scale, for group-wise weights), and the sub-groups add up in
    order in float32; per-channel weight scales multiply the sum last.

    Returns:
        float32 ``[M, N]``.

    Raises:
        QuantizationInputError: groupings that do not nest (one group size a multiple of the other).
    """
    k, act_groups = weight.in_features, scale.shape[1]
    act = k // act_groups
    w_group = weight.group_size or k
    sub = min(act, w_group)
    if act_groups * act != k or max(act, w_group) % sub:
        raise QuantizationInputError(f"svdquant: activation groups of {act} and weight groups of {w_group} input "
                                     "channels must nest (one a multiple of the other)")
    codes = unpack_int4(weight.qweight, weight.group_size).double()
    qx = q.double()
    w_scales = weight.scales.float()
    acc = torch.zeros(q.shape[0], weight.out_features, dtype=torch.float32, device=q.device)
    for i in range(k // sub):
        cols = slice(i * sub, (i + 1) * sub)
        part = (qx[:, cols] @ codes[:, cols].t()).float() * scale.float()[:, (i * sub) // act, None]
        acc = acc + (part if weight.group_size == PER_CHANNEL else part * w_scales[(i * sub) // w_group])
    return acc * w_scales[0] if weight.group_size == PER_CHANNEL else acc


def lowrank_reference(x2d: torch.Tensor, weight: SVDQuantWeight) -> torch.Tensor | None:
    """The low-rank branch as the GPU computes it: ``t = bf16(bf16(x) @ D.T)``, then ``t @ U.T`` in float32."""
    if weight.lora_down is None or weight.lora_up is None:
        return None
    t = (x2d.to(LOWRANK_DTYPE).float() @ weight.lora_down.float().t()).to(LOWRANK_DTYPE)
    return t.float() @ weight.lora_up.float().t()


def w4a8_linear_reference(x: torch.Tensor, weight: SVDQuantWeight, bias: torch.Tensor | None = None, *,
                          act_group: int | None = None) -> torch.Tensor:
    """Reference W4A8 SVDQuant Linear: per-token INT8 of ``x / λ``, INT4 residual GEMM, low-rank, bias.

    Args:
        x: ``[..., K]`` float activations.
        weight: the decomposed weight, on ``x``'s device.
        bias: optional ``[N]``.
        act_group: one activation scale per token and group of this many input channels
            (:func:`int4_gemm_reference_grouped`) instead of one per token.

    Returns:
        ``[..., N]`` in ``x``'s dtype (float32 math).

    Raises:
        QuantizationInputError: ``x``'s last dimension does not match.
    """
    x2d = _rows(x, weight)
    if act_group is not None:
        q, scale = quantize_rows_int8_grouped(x2d, weight.inv_smooth, act_group)
        return _finish(int4_gemm_reference_grouped(q, scale, weight), x, x2d, weight, bias)
    q, scale = quantize_rows_int8(x2d, weight.inv_smooth)
    out = int4_gemm_reference(q, scale, weight)
    return _finish(out, x, x2d, weight, bias)


def w4f8_linear_reference(x: torch.Tensor, weight: SVDQuantWeight, bias: torch.Tensor | None = None, *,
                          lowrank_from_codes: bool = False) -> torch.Tensor:
    """Reference W4F8 SVDQuant Linear: per-token FP8 e4m3 of ``x / λ`` (:func:`quantize_rowwise_fp8` of the smoothed
    rows), the INT4 residual GEMM on those codes, low-rank, bias.

    Args:
        lowrank_from_codes: the low-rank branch on the dequantized codes, ``(q_x * s_x) @ (D * λ).T`` in float32
            (the cuBLAS path), instead of ``bf16(x) @ D.T`` (the Triton W4F8 kernel).

    Returns:
        ``[..., N]`` in ``x``'s dtype (float32 math; the residual sum in float64, the kernel's in float32).
    """
    x2d = _rows(x, weight)
    q, scale = quantize_rowwise_fp8(smoothed_rows(x2d, weight.inv_smooth))
    out = int4_gemm_reference(q, scale, weight)
    if not lowrank_from_codes or weight.lora_down is None or weight.lora_up is None:
        return _finish(out, x, x2d, weight, bias)
    down = weight.lora_down.float()
    if weight.inv_smooth is not None:
        down = down / weight.inv_smooth.float()[None, :]
    out = out + ((q.float() * scale) @ down.t()) @ weight.lora_up.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


def w4a16_linear_reference(x: torch.Tensor, weight: SVDQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference W4A16 SVDQuant Linear: ``bf16(x / λ) @ bf16(deq(R)).T`` in float32, low-rank, bias.

    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    x2d = _rows(x, weight)
    xs = x2d.float() if weight.inv_smooth is None else x2d.float() * weight.inv_smooth.float()
    deq = dequantize_int4_groupwise(weight.qweight, weight.scales, weight.group_size, torch.bfloat16)
    out = xs.to(torch.bfloat16).float() @ deq.float().t()
    return _finish(out, x, x2d, weight, bias)


def _rows(x: torch.Tensor, weight: SVDQuantWeight) -> torch.Tensor:
    if x.shape[-1] != weight.in_features:
        raise QuantizationInputError(
            f"svdquant linear: input has {x.shape[-1]} features, the weight expects {weight.in_features}"
        )
    return x.reshape(-1, weight.in_features)


def _finish(out: torch.Tensor, x: torch.Tensor, x2d: torch.Tensor, weight: SVDQuantWeight,
            bias: torch.Tensor | None) -> torch.Tensor:
    lowrank = lowrank_reference(x2d, weight)
    if lowrank is not None:
        out = out + lowrank
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


__all__ = [
    "LOWRANK_DTYPE",
    "ROUNDINGS",
    "SVD_METHODS",
    "SVDQuantWeight",
    "decompose",
    "int4_gemm_reference",
    "int4_gemm_reference_grouped",
    "lowrank_reference",
    "smoothing_factors",
    "w4a16_linear_reference",
    "w4a8_linear_reference",
    "w4f8_linear_reference",
    "weight_rel_error",
]
