"""Fused rowwise FP8 activation quantization (Triton): row amax -> scale -> cast in one pass over the input.

The kernel computes exactly :func:`~worldfoundry.core.acceleration.quantization.fp8.quantize_rowwise_fp8`
(re-exported here as :func:`reference_quantize_rowwise_fp8`, the torch reference of the same function): the
same float32 amax, the same IEEE-rounded divisions for the scale and its reciprocal (``tl.div_rn``, once per
row), one rounded product per element and round-to-nearest-even onto the e4m3 grid. FP8 bytes and scales are
bitwise equal to the reference for every finite input.

Rounding onto the e4m3 grid: on CUDA the cast is the hardware conversion (``cvt.rn.satfinite.e4m3x2.f32``,
round to nearest even, the same as torch's cast). The Triton interpreter converts float32 to FP8 differently
(ties away from zero, and a carry bug), so there the kernel first rounds explicitly in float32 bit arithmetic
(``SOFTWARE_ROUNDING``) and the cast only sees values FP8 represents exactly. Both give the same bytes; the
GPU tests check the two paths against the reference.

Rows of up to :data:`SINGLE_PASS_MAX_K` elements are read once and kept in registers. Longer rows are read
twice (amax pass, then quantize pass), the second read mostly served from L2.

Optionally the kernel adds the number of clipped elements (``|x * (1 / scale)| >= 464`` or non-finite: with
dynamic per-row scaling only non-finite inputs clip) to an int32 counter on the device, with one atomic per
program and only when the program saw a clipped element.

Example (CPU, with ``TRITON_INTERPRET=1`` set before triton is imported)::

    q, scale = triton_quantize_rowwise_fp8(torch.randn(4, 64))
"""

from __future__ import annotations

import logging
import os
from typing import Any, Final

import torch

from worldfoundry.core.acceleration.quantization.fp8 import (
    AMAX_FLOOR,
    CLIP_THRESHOLD,
    FP8_DTYPE,
    FP8_E4M3_MAX,
)
from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8 as reference_quantize_rowwise_fp8
from worldfoundry.errors import QuantizationInputError

logger = logging.getLogger(__name__)

try:  # triton is an optional dependency (extra "triton")
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

#: True when the ``triton`` package imported.
TRITON_AVAILABLE: Final = triton is not None
#: Rows up to this many elements are quantized in one pass (whole row in registers).
SINGLE_PASS_MAX_K: Final = 16384
#: Chunk width for longer rows (two passes).
MULTI_PASS_BLOCK_K: Final = 4096
#: Elements handled per program (rows are grouped until a program holds about this many).
TARGET_ELEMENTS_PER_PROGRAM: Final = 4096


def interpreter_enabled() -> bool:
    """Whether Triton runs in interpreter mode (``TRITON_INTERPRET=1``), which accepts CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if TRITON_AVAILABLE:

    @triton.jit
    def _round_to_e4m3_grid(y):
        """Round float32 ``y`` (already within [-448, 448]) to the nearest e4m3fn value, ties to even."""
        bits = y.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        sign = bits ^ mag
        # normal range: keep 3 mantissa bits, round half to even (carry into the exponent is correct)
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) << 20
        # subnormal range (< 2**-6): multiples of 2**-9, rounded half to even by one float32 addition of 2**14
        # (whose ulp is 2**-9) and its exact subtraction
        a = mag.to(tl.float32, bitcast=True)
        sub = ((a + 16384.0) - 16384.0).to(tl.int32, bitcast=True)
        rounded = tl.where(a < 0.015625, sub, normal) | sign
        return rounded.to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_rowwise_quant_kernel(
        x_ptr, q_ptr, scale_ptr, clip_ptr,
        M, K, stride_xm, stride_qm,
        fp8_max, amax_floor, clip_threshold,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        SINGLE_PASS: tl.constexpr, COUNT_CLIPS: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows64[:, None] * stride_xm
        q_rows = q_ptr + rows64[:, None] * stride_qm
        clipped = tl.zeros([BLOCK_M], dtype=tl.int32)
        if SINGLE_PASS:
            mask = row_mask[:, None] & (cols[None, :] < K)
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)
            scale = tl.div_rn(tl.maximum(amax, amax_floor), fp8_max)
            inv = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), scale)
            y = x * inv[:, None]
            if COUNT_CLIPS:
                clipped += tl.sum(tl.where(tl.abs(y) < clip_threshold, 0, 1), axis=1)
            y = tl.minimum(tl.maximum(y, -fp8_max), fp8_max)
            if SOFTWARE_ROUNDING:
                y = _round_to_e4m3_grid(y)
            q = y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(q_rows + cols[None, :], q, mask=mask)
        else:
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + cols
                mask = row_mask[:, None] & (kk[None, :] < K)
                x = tl.load(x_rows + kk[None, :], mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            scale = tl.div_rn(tl.maximum(amax, amax_floor), fp8_max)
            inv = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), scale)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + cols
                mask = row_mask[:, None] & (kk[None, :] < K)
                x = tl.load(x_rows + kk[None, :], mask=mask, other=0.0).to(tl.float32)
                y = x * inv[:, None]
                if COUNT_CLIPS:
                    clipped += tl.sum(tl.where(tl.abs(y) < clip_threshold, 0, 1), axis=1)
                y = tl.minimum(tl.maximum(y, -fp8_max), fp8_max)
                if SOFTWARE_ROUNDING:
                    y = _round_to_e4m3_grid(y)
                q = y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
                tl.store(q_rows + kk[None, :], q, mask=mask)
        tl.store(scale_ptr + rows64, scale, mask=row_mask)
        if COUNT_CLIPS:
            total = tl.sum(tl.where(row_mask, clipped, 0), axis=0)
            if total > 0:
                tl.atomic_add(clip_ptr, total)


def launch_config(k: int) -> dict[str, Any]:
    """Block sizes and warps used for rows of ``k`` elements (shared by the launcher, tests and benchmarks).

    Returns:
        ``{"BLOCK_M", "BLOCK_K", "SINGLE_PASS", "num_warps"}``.

    Raises:
        QuantizationInputError: triton is not importable.
    """
    if not TRITON_AVAILABLE:
        raise QuantizationInputError("triton is not installed; install the 'triton' extra or use the torch reference")
    block_k = triton.next_power_of_2(max(int(k), 16))
    single = block_k <= SINGLE_PASS_MAX_K
    if not single:
        block_k = MULTI_PASS_BLOCK_K
    block_m = max(1, min(64, TARGET_ELEMENTS_PER_PROGRAM // block_k))
    elements = block_m * block_k
    num_warps = 4 if elements <= 4096 else (8 if elements <= 8192 else 16)
    return {"BLOCK_M": block_m, "BLOCK_K": block_k, "SINGLE_PASS": single, "num_warps": num_warps}


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D ``[M, K]`` view (or copy) of ``x`` whose rows are evenly spaced and whose last stride is 1."""
    k = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    if rows.stride(-1) != 1 and rows.shape[-1] > 1:
        rows = rows.contiguous()
    return rows


def triton_quantize_rowwise_fp8(
    x: torch.Tensor, *, clip_counter: torch.Tensor | None = None, software_rounding: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize every row of ``x`` with the fused Triton kernel (same result as the torch reference).

    Args:
        x: float tensor ``[..., K]`` on a CUDA device (or on the CPU with ``TRITON_INTERPRET=1``). Rows may be
            strided (a slice of a wider tensor); a last-dimension stride other than 1 costs one copy.
        clip_counter: optional int32 tensor with one element on ``x``'s device; the number of clipped elements
            is added to it (no host synchronisation).
        software_rounding: round onto the e4m3 grid in float32 bit arithmetic before the cast. ``None``
            (default) does so only under the interpreter; on CUDA both settings give the same bytes.

    Returns:
        ``(q, scale)`` exactly like
        :func:`~worldfoundry.core.acceleration.quantization.fp8.quantize_rowwise_fp8`: ``q`` contiguous
        float8_e4m3fn of ``x``'s shape, ``scale`` float32 ``[..., 1]``.

    Raises:
        QuantizationInputError: triton is missing, the tensor is on the CPU without the interpreter, has an
            unsupported dtype, or ``clip_counter`` is not a one-element int32 tensor on the same device.
    """
    if not TRITON_AVAILABLE:
        raise QuantizationInputError("triton is not installed; install the 'triton' extra or use the torch reference")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise QuantizationInputError(
            f"triton_quantize_rowwise_fp8: expected a float32/float16/bfloat16 tensor, got {getattr(x, 'dtype', x)!r}"
        )
    if x.dim() < 1 or x.shape[-1] == 0:
        raise QuantizationInputError(f"triton_quantize_rowwise_fp8: empty last dimension in shape {tuple(x.shape)}")
    if x.device.type != "cuda" and not interpreter_enabled():
        raise QuantizationInputError(
            f"triton_quantize_rowwise_fp8: tensor on {x.device}; the kernel needs a CUDA device "
            "(or TRITON_INTERPRET=1 for CPU tests)"
        )
    if clip_counter is not None and (
        clip_counter.dtype != torch.int32 or clip_counter.numel() != 1 or clip_counter.device != x.device
    ):
        raise QuantizationInputError("clip_counter must be a one-element int32 tensor on the input's device")
    shape = x.shape
    k = shape[-1]
    rows = _as_rows(x)
    m = rows.shape[0]
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m > 0:
        cfg = launch_config(k)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]),)
        counter = clip_counter if clip_counter is not None else scale
        args = (
            rows, q, scale, counter, m, k, rows.stride(0), q.stride(0),
            FP8_E4M3_MAX, AMAX_FLOOR, CLIP_THRESHOLD,
        )
        kwargs = dict(
            BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], SINGLE_PASS=cfg["SINGLE_PASS"],
            COUNT_CLIPS=clip_counter is not None,
            SOFTWARE_ROUNDING=interpreter_enabled() if software_rounding is None else bool(software_rounding),
            num_warps=cfg["num_warps"],
        )
        if x.device.type == "cuda" and x.device.index is not None and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                _fp8_rowwise_quant_kernel[grid](*args, **kwargs)
        else:
            _fp8_rowwise_quant_kernel[grid](*args, **kwargs)
    return q.view(shape), scale.view(*shape[:-1], 1)


__all__ = [
    "SINGLE_PASS_MAX_K",
    "TRITON_AVAILABLE",
    "interpreter_enabled",
    "launch_config",
    "reference_quantize_rowwise_fp8",
    "triton_quantize_rowwise_fp8",
]
