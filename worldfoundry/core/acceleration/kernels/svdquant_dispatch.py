"""Backend choice for the SVDQuant Linear -- always saying why a backend was not used:

* ``w4f8`` (Hopper, per-channel residual scales): FP8 activations and the INT4 codes widened to FP8, one
  ``torch._scaled_mm`` with the low-rank branch appended to the reduction
  (:mod:`~worldfoundry.core.acceleration.kernels.w4f8_scaled_mm`); ``auto`` on sm_90+ for per-channel weights;
* ``w4a8`` (INT8 tensor cores): ``auto`` on sm_90+ for group-wise scales (and where ``w4f8`` cannot run); per-channel
  weights on a Hopper GPU run the persistent Gluon GEMM with asynchronous int8 ``wgmma``
  (:mod:`~worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent`; recorded as ``w4a8_gluon``), everything
  else the Triton one;
* ``w4a16`` (Triton) on other CUDA GPUs; the torch reference of the W4A8 numerics elsewhere -- or, when ``w4f8``
  is asked for explicitly off CUDA, ``reference_w4f8``: the torch reference of the W4F8 numerics (FP8
  activations, the low-rank branch on the codes), and when ``w4a16`` is, ``reference_w4a16`` (bfloat16
  activations, no activation quantization), so a CPU run shows what the GPU backend computes.

Example:
    >>> import torch
    >>> from worldfoundry.core.acceleration.quantization.svdquant_numerics import decompose
    >>> w = pad_rank(decompose(torch.randn(32, 64), rank=4, group_size=64))
    >>> y, used = svdquant_linear(torch.randn(3, 64), w, None)
    >>> used.backend, used.reason, tuple(y.shape)
    ('reference', 'cpu device', (3, 32))
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Final

import torch
import torch.nn.functional as F

from worldfoundry.core.acceleration.kernels.int8_act_quant import (
    TRITON_AVAILABLE,
    interpreter_enabled,
    triton_quantize_rows_int8,
)
from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import triton_quantize_rows_int8_lowrank
from worldfoundry.core.acceleration.kernels.int8_grouped_quant_lowrank import GROUPS as GROUPED_QUANT_GROUPS
from worldfoundry.core.acceleration.kernels.int8_grouped_quant_lowrank import triton_quantize_rows_int8_grouped_lowrank
from worldfoundry.core.acceleration.kernels.w4a8_gemm import CHANNEL_ACT_GROUPS, triton_w4a8_gemm, triton_w4a16_gemm
from worldfoundry.core.acceleration.kernels.w4a8_gluon_grouped import GLUON_ACT_GROUPS, gluon_w4a8_grouped_gemm
from worldfoundry.core.acceleration.kernels.w4a8_gluon_kernels import GLUON_AVAILABLE
from worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent import check_row_max, gluon_w4a8_persistent_gemm
from worldfoundry.core.acceleration.kernels.w4f8_scaled_mm import ScaledMMWeight, prepare_scaled_mm, scaled_mm_w4f8
from worldfoundry.core.acceleration.quantization.int4_packing import PER_CHANNEL
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8_grouped
from worldfoundry.core.acceleration.quantization.svdquant_numerics import (
    LOWRANK_DTYPE,
    SVDQuantWeight,
    w4a8_linear_reference,
    w4a16_linear_reference,
    w4f8_linear_reference,
)
from worldfoundry.errors import QuantizationInputError

BACKENDS: Final = ("auto", "w4f8", "w4a8", "w4a16", "reference")
#: Kind of a call that ran the torch reference of the W4F8 numerics (``w4f8`` asked for off CUDA).
REFERENCE_W4F8: Final = "reference_w4f8"
REFERENCE_W4A16: Final = "reference_w4a16"
#: Kind of a ``w4a8`` call that ran the persistent Gluon GEMM (per-channel weights on a Hopper GPU).
W4A8_GLUON: Final = "w4a8_gluon"
#: Smallest capability ``auto`` runs W4A8 on (Hopper); INT8 tensor cores exist from sm_75/sm_80.
W4A8_AUTO_CAPABILITY: Final = (9, 0)
W4A8_MIN_CAPABILITY: Final = (8, 0)
REASON_TRITON_MISSING: Final = "triton not importable"
REASON_NOT_HOPPER: Final = "gpu below sm_90: W4A16"
REASON_NO_INT8_TC: Final = "gpu below sm_80 lacks int8 tensor cores: W4A16"
#: Smallest capability with FP8 tensor cores (``torch._scaled_mm`` row-wise scaling runs on sm_89+).
W4F8_MIN_CAPABILITY: Final = (8, 9)
REASON_NO_FP8_TC: Final = "gpu below sm_89 lacks fp8 tensor cores"
REASON_GROUPED: Final = "group-wise residual scales: W4A8 (W4F8 needs one scale per output channel)"
#: Inputs wider than this quantize and project down in one kernel (:mod:`.int8_quant_lowrank`: ``x`` read from
#: DRAM once instead of three times) when nothing else is asked. ``None``: never. With its first launch shape
#: (32 rows x 256) the fused kernel made the W81 8960 -> 1536 Linear slower (2.08 ms against 1.56 ms,
#: ``benchmarks/kernels/svdquant.py``); with its current one (64 x 256, 8 warps) the whole Linear measured faster
#: fused at both FFN widths on the H200 (``benchmarks/kernels/w4a8_linear.py``, interleaved against bf16: 1.175x
#: against 1.090x, 0.936x against 0.867x), so every width takes it.
FUSED_QUANT_LOWRANK_MIN_K: Final[int | None] = 0


@dataclass(frozen=True)
class BackendChoice:
    """What ran: ``backend`` in ``("w4f8", "w4a8", "w4a8_gluon", "w4a16", "reference", "reference_w4f8",
    "reference_w4a16")``, and why
    it is not the requested one."""

    backend: str
    reason: str | None = None


def pad_rank(weight: SVDQuantWeight) -> SVDQuantWeight:
    """Pad the low-rank pair with zeros to a power-of-two rank >= 16 (the kernels' dot shape); exact."""
    if weight.lora_down is None or weight.lora_up is None:
        return weight
    rank = weight.rank
    target = max(16, 1 << (rank - 1).bit_length())
    if target == rank:
        return weight
    down = torch.zeros((target, weight.in_features), dtype=weight.lora_down.dtype, device=weight.device)
    up = torch.zeros((weight.out_features, target), dtype=weight.lora_up.dtype, device=weight.device)
    down[:rank] = weight.lora_down
    up[:, :rank] = weight.lora_up
    return replace(weight, lora_down=down, lora_up=up)


@functools.lru_cache(maxsize=64)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _hopper(device: torch.device) -> bool:
    """Whether ``device`` is a Hopper GPU (sm_90: ``wgmma``)."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] == 9


def choose_backend(device: torch.device, requested: str = "auto", group_size: int = PER_CHANNEL) -> BackendChoice:
    """The backend that runs on ``device`` for ``requested`` and a residual of ``group_size``.

    ``auto``: on sm_90+ W4F8 for per-channel weights and W4A8 for group-wise ones, W4A16 on other CUDA GPUs, the
    reference on the CPU. ``w4f8`` falls back to W4A8 (group-wise weights, or a GPU without FP8 tensor cores)
    with the reason. ``w4f8`` runs on CUDA only (``torch._scaled_mm``); an explicit ``w4a8`` or ``w4a16`` on the
    CPU runs the Triton kernel only under ``TRITON_INTERPRET=1`` (tests), otherwise the reference.

    Raises:
        QuantizationInputError: unknown backend.
    """
    if requested not in BACKENDS:
        raise QuantizationInputError(f"unknown svdquant backend {requested!r}; use one of {', '.join(BACKENDS)}")
    if requested == "reference":
        return BackendChoice("reference")
    if not TRITON_AVAILABLE:
        return _reference(requested, group_size, REASON_TRITON_MISSING)
    if device.type != "cuda":
        if requested in ("w4a8", "w4a16") and interpreter_enabled():
            return BackendChoice(requested)
        return _reference(requested, group_size, f"{device.type} device")
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capability(index)
    if requested == "w4a16":
        return BackendChoice("w4a16")
    if requested == "w4f8" or (requested == "auto" and cap >= W4A8_AUTO_CAPABILITY):
        reason = REASON_GROUPED if group_size != PER_CHANNEL else (
            REASON_NO_FP8_TC if cap < W4F8_MIN_CAPABILITY else None)
        if reason is None:
            return BackendChoice("w4f8")
        if requested == "w4f8":
            fallback = choose_backend(device, "w4a8", group_size)
            return replace(fallback, reason=fallback.reason or reason)
        return BackendChoice("w4a8")
    if requested == "w4a8":
        return BackendChoice("w4a8") if cap >= W4A8_MIN_CAPABILITY else BackendChoice("w4a16", REASON_NO_INT8_TC)
    return BackendChoice("w4a16", REASON_NOT_HOPPER)


def _reference(requested: str, group_size: int, reason: str) -> BackendChoice:
    """The torch reference of the numerics ``requested`` stands for: W4F8's (per-channel weights), W4A16's, else
    W4A8's."""
    if requested == "w4f8" and group_size == PER_CHANNEL:
        return BackendChoice(REFERENCE_W4F8, reason)
    if requested == "w4a16":
        return BackendChoice(REFERENCE_W4A16, reason)
    return BackendChoice("reference", reason)


def lowrank_down(x2d: torch.Tensor, weight: SVDQuantWeight) -> torch.Tensor | None:
    """``t = bf16(x) @ D.T`` (bfloat16 ``[M, r]``, one bfloat16 GEMM), or ``None`` for rank 0."""
    if weight.lora_down is None:
        return None
    return F.linear(x2d.to(LOWRANK_DTYPE), weight.lora_down)


def svdquant_linear(x: torch.Tensor, weight: SVDQuantWeight, bias: torch.Tensor | None, *,
                    backend: str = "auto", fused_lowrank: bool | None = None,
                    scaled: ScaledMMWeight | None = None, fast_accum: bool = True,
                    one_launch: bool = False, act_group: int | None = None,
                    row_max: torch.Tensor | None = None) -> tuple[torch.Tensor, BackendChoice]:
    """The SVDQuant Linear ``[..., K] -> [..., N]`` on the chosen backend.

    Args:
        x: float activations on ``weight``'s device.
        weight: rank-padded decomposed weight (:func:`pad_rank`).
        bias: optional ``[N]``.
        backend: ``auto``, ``w4a8``, ``w4a16`` or ``reference``.
        fused_lowrank: W4A8 only: quantize and project down in one kernel (``None``: when ``K`` exceeds
            :data:`FUSED_QUANT_LOWRANK_MIN_K`, 0: always). Same codes either way.
        scaled: W4F8 only: :func:`~worldfoundry.core.acceleration.kernels.w4f8_scaled_mm.prepare_scaled_mm` of
            ``weight`` (prepared here when ``None``; a weight it refuses runs W4A8, with the reason).
        fast_accum: W4F8 only: ``torch._scaled_mm``'s fast accumulation.
        one_launch: W4F8 only: the activation operand (codes and appended low-rank codes) in one launch.
        act_group: INT8 activation scales per token and group of this many input channels instead of per token
            (the reference, or W4A8: group-wise weights of that group size on the Triton GEMM, per-channel weights
            and groups of 128 or 256 on :func:`grouped_gemm_from_codes`); other backends refuse it.
        row_max: W4A8 only: float32 ``[M]`` (``M`` rows of ``x``) into which each output row's largest value,
            floored at 0, is merged (pass zeros): the persistent GEMM's epilogue writes it, the Triton GEMM's output
            is reduced after it. The FFN producer fusion reads it (one pass over the output).

    Returns:
        ``(output in x.dtype, BackendChoice that ran)``.

    Raises:
        QuantizationInputError: unknown backend, mismatched features or devices.
    """
    if x.shape[-1] != weight.in_features:
        raise QuantizationInputError(
            f"svdquant linear: input has {x.shape[-1]} features, the weight expects {weight.in_features}")
    if x.device != weight.device:
        raise QuantizationInputError(f"svdquant linear: input on {x.device}, weights on {weight.device}")
    choice = choose_backend(x.device, backend, weight.group_size)
    if row_max is not None and (choice.backend != "w4a8" or act_group is not None):
        raise QuantizationInputError(f"svdquant linear: row_max is written by the W4A8 GEMM with per-token "
                                     f"activation scales only (backend {choice.backend}, act_group {act_group})")
    if act_group is not None:
        return _grouped_activations(x, weight, bias, act_group, choice)
    if choice.backend == "w4f8":
        out, choice = _w4f8(x, weight, bias, scaled, fast_accum, one_launch)
        if out is not None:
            return out, choice
    if choice.backend in ("reference", REFERENCE_W4F8, REFERENCE_W4A16):
        return reference_for(choice.backend)(x, weight, bias), choice
    lead = x.shape[:-1]
    x2d = x.reshape(-1, weight.in_features)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if choice.backend == "w4a8":
        out, choice = _w4a8(x2d, weight, bias, fused_lowrank, x.dtype, choice, row_max)
    else:
        out = triton_w4a16_gemm(x2d, weight, lowrank_down(x2d, weight), bias, out_dtype=x.dtype)
    return out.reshape(*lead, weight.out_features), choice


def _w4a8(x2d: torch.Tensor, weight: SVDQuantWeight, bias: torch.Tensor | None, fused_lowrank: bool | None,
          out_dtype: torch.dtype, choice: BackendChoice,
          row_max: torch.Tensor | None) -> tuple[torch.Tensor, BackendChoice]:
    """Per-token INT8 codes and the low-rank down projection of ``x2d``, then the W4A8 GEMM."""
    if fused_lowrank is None:
        limit = FUSED_QUANT_LOWRANK_MIN_K
        fused_lowrank = limit is not None and weight.in_features > limit
    if fused_lowrank and weight.lora_down is not None:
        q, scale, t = triton_quantize_rows_int8_lowrank(x2d, weight.inv_smooth, weight.lora_down)
    else:
        t = lowrank_down(x2d, weight)
        q, scale = triton_quantize_rows_int8(x2d, weight.inv_smooth)
    return w4a8_gemm_from_codes(q, scale, weight, t, bias, out_dtype, choice, row_max=row_max)


def _grouped_activations(x: torch.Tensor, weight: SVDQuantWeight, bias: torch.Tensor | None, group: int,
                         choice: BackendChoice) -> tuple[torch.Tensor, BackendChoice]:
    """The W4A8 Linear with activation scales per token and group: the reference, or the grouped quantizer and
    :func:`grouped_gemm_from_codes`."""
    if choice.backend == "reference":
        return w4a8_linear_reference(x, weight, bias, act_group=group), choice
    takes = group in CHANNEL_ACT_GROUPS if weight.group_size == PER_CHANNEL else weight.group_size == group
    if choice.backend != "w4a8" or not takes:
        raise QuantizationInputError(
            f"svdquant linear: activation scales per group of {group} run on the reference, or on W4A8 with "
            f"group-wise weights of group {group} or per-channel weights and groups of 128 or 256 (this weight: "
            f"group_size {weight.group_size}, backend {choice.backend})")
    x2d = x.reshape(-1, weight.in_features)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if group in GROUPED_QUANT_GROUPS:  # codes, scales and t from one read of x (scales as the Gluon GEMM reads them)
        q, scale, t = triton_quantize_rows_int8_grouped_lowrank(x2d, weight.inv_smooth, weight.lora_down, group,
                                                                transposed_scales=_gluon_grouped(x.device, weight))
    else:
        q, scale = quantize_rows_int8_grouped(x2d, weight.inv_smooth, group)
        t = lowrank_down(x2d, weight)
    out, choice = grouped_gemm_from_codes(q, scale, weight, t, bias, x.dtype, choice)
    return out.reshape(*x.shape[:-1], weight.out_features), choice


def _gluon_grouped(device: torch.device, weight: SVDQuantWeight) -> bool:
    """Whether the Gluon grouped GEMM can take this weight on ``device`` (per channel, a Hopper GPU, Gluon)."""
    return weight.group_size == PER_CHANNEL and _hopper(device) and GLUON_AVAILABLE and not interpreter_enabled()


def grouped_gemm_from_codes(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None,
                            bias: torch.Tensor | None, out_dtype: torch.dtype,
                            choice: BackendChoice) -> tuple[torch.Tensor, BackendChoice]:
    """The W4A8 GEMM of codes with scales per token and group (``scale [M, K / group]``): the Gluon grouped kernel
    for per-channel weights and groups of 64-256 on a Hopper GPU, else the Triton one (a Gluon refusal is named in
    the reason)."""
    reason = choice.reason
    if _gluon_grouped(q.device, weight) and weight.in_features // max(scale.shape[1], 1) in GLUON_ACT_GROUPS:
        try:
            out = gluon_w4a8_grouped_gemm(q, scale, weight, t, bias)
            return out.to(out_dtype), BackendChoice(W4A8_GLUON, reason)
        except QuantizationInputError as exc:  # operands outside the kernel's shapes
            reason = reason or f"gluon w4a8 refused: {exc}"
    out = triton_w4a8_gemm(q, scale.contiguous(), weight, t, bias, out_dtype=out_dtype)
    return out, BackendChoice("w4a8", reason)


def w4a8_gemm_from_codes(q: torch.Tensor, scale: torch.Tensor, weight: SVDQuantWeight, t: torch.Tensor | None,
                         bias: torch.Tensor | None, out_dtype: torch.dtype, choice: BackendChoice, *,
                         row_max: torch.Tensor | None = None) -> tuple[torch.Tensor, BackendChoice]:
    """The W4A8 GEMM of quantized activations (``q`` int8 ``[M, K]``, ``scale`` ``[M, 1]``, ``t`` the low-rank
    down projection or ``None``), returning the output in ``out_dtype`` and what ran: the persistent Gluon kernel
    (asynchronous int8 ``wgmma``) for per-channel weights on a Hopper GPU, else the Triton one; a Gluon refusal
    is named in the reason. ``row_max`` (float32 ``[M]``) receives each output row's largest value floored at 0,
    merged with what it holds (the Gluon epilogue; after the Triton GEMM, a reduction of its output)."""
    reason = choice.reason
    check_row_max(row_max, q.shape[0], q.device)
    if weight.group_size == PER_CHANNEL and _hopper(q.device) and GLUON_AVAILABLE and not interpreter_enabled():
        try:
            out = gluon_w4a8_persistent_gemm(q, scale, weight, t, bias, row_max=row_max)
            return out.to(out_dtype), BackendChoice(W4A8_GLUON, reason)
        except QuantizationInputError as exc:  # not a Hopper GPU, or operands outside the kernel's shapes
            reason = reason or f"gluon w4a8 refused: {exc}"
    out = triton_w4a8_gemm(q, scale, weight, t, bias, out_dtype=out_dtype)
    if row_max is not None and out.shape[0]:
        torch.maximum(row_max, out.amax(dim=1).float().clamp_min(0.0), out=row_max)
    return out, BackendChoice("w4a8", reason)


def _w4f8(x: torch.Tensor, weight: SVDQuantWeight, bias: torch.Tensor | None, scaled: ScaledMMWeight | None,
          fast_accum: bool, one_launch: bool = False) -> tuple[torch.Tensor | None, BackendChoice]:
    """The W4F8 Linear, or ``(None, W4A8 with the reason)`` when its preparation refuses the weight."""
    try:
        prep = scaled if scaled is not None else prepare_scaled_mm(weight)
    except QuantizationInputError as exc:
        return None, BackendChoice("w4a8", f"w4f8 refused: {exc}")
    x2d = x.reshape(-1, weight.in_features)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = scaled_mm_w4f8(x2d, weight, prep, bias, use_fast_accum=fast_accum, one_launch=one_launch)
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features), BackendChoice("w4f8")


def reference_for(backend: str):  # noqa: ANN201 - returns one of three reference functions
    """The torch reference of a backend's numerics (``w4a16`` and ``w4f8`` have their own; everything else is
    W4A8's)."""
    if backend in ("w4f8", REFERENCE_W4F8):
        return functools.partial(w4f8_linear_reference, lowrank_from_codes=True)
    return w4a16_linear_reference if backend in ("w4a16", REFERENCE_W4A16) else w4a8_linear_reference


__all__ = [
    "BACKENDS",
    "FUSED_QUANT_LOWRANK_MIN_K",
    "REFERENCE_W4A16",
    "REFERENCE_W4F8",
    "W4A8_GLUON",
    "BackendChoice",
    "choose_backend",
    "grouped_gemm_from_codes",
    "lowrank_down",
    "pad_rank",
    "w4a8_gemm_from_codes",
    "reference_for",
    "svdquant_linear",
]
