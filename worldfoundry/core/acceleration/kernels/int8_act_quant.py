"""Per-token INT8 activation quantization with smoothing (Triton), beside its torch reference.

:func:`triton_quantize_rows_int8` computes exactly
:func:`~worldfoundry.core.acceleration.quantization.int8_activation.quantize_rows_int8` (re-exported here as
:func:`reference_quantize_rows_int8`): the same float32 product ``x * inv_smooth``, the same row maximum, the
same IEEE divisions ``a / 127`` and ``127 / a`` (``tl.div_rn``, once per row), one rounded product per element
and round-half-to-even. Codes and scales are bitwise equal to the reference for every finite input.

Rounding to the nearest integer uses the float32 identity ``(y + 1.5 * 2**23) - 1.5 * 2**23`` (exact
round-half-to-even for ``|y| < 2**22``; here ``|y| <= 127``), which the Triton interpreter also runs (it has no
``rint``).

Rows of up to 16,384 elements are read once and kept in registers (``SINGLE_PASS``), split into at most three
power-of-two pieces so that no lane is padding; longer rows are read twice in 1,024-wide chunks (row maximum,
then quantize). Both give the same bytes (the row maximum is exact in any order; the rest is per element).

Example (CPU, with ``TRITON_INTERPRET=1`` set before triton is imported)::

    q, scale = triton_quantize_rows_int8(torch.randn(4, 64), inv_smooth=None)
"""

from __future__ import annotations

import os
from typing import Final

import torch

from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import row_pieces
from worldfoundry.core.acceleration.quantization.int8_activation import INT8_AMAX_FLOOR
from worldfoundry.core.acceleration.quantization.int8_activation import (
    quantize_rows_int8 as reference_quantize_rows_int8,
)
from worldfoundry.errors import QuantizationInputError

try:  # triton is an optional dependency (extra "triton")
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

TRITON_AVAILABLE: Final = triton is not None
#: ``1.5 * 2**23``: adding and subtracting it rounds a float32 of magnitude < 2**22 to an integer, ties to even.
ROUND_MAGIC: Final = 12582912.0
_FLOAT_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16)


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1`` (kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if TRITON_AVAILABLE:

    @triton.jit
    def _load_piece(x_ptr, inv_ptr, row_base, rmask, start, K, WIDTH: tl.constexpr, HAS_SMOOTH: tl.constexpr):
        """Columns ``start .. start + WIDTH`` of the rows as float32 (times ``inv_smooth``), mask and columns."""
        cols = start + tl.arange(0, WIDTH)
        cmask = cols < K
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + row_base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            x = x * tl.load(inv_ptr + cols, mask=cmask, other=0.0)[None, :]
        return x, mask, cols

    @triton.jit
    def _store_codes(q_ptr, out_base, x, rcp, mask, cols):
        """``clamp(round_half_even(x * rcp), -127, 127)`` as int8 (the product rounds first: no FMA).

        Clamped first (the bounds are integers, so the order does not matter), then ``+ 1.5 * 2**23`` puts the
        rounded integer in the float's low mantissa bits, whose low byte is the two's-complement code: no
        float-to-int conversion, which runs on the quarter-rate conversion unit of an H100/H200 SM."""
        y = tl.minimum(tl.maximum(x * rcp[:, None], -127.0), 127.0)
        q = (y + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)
        tl.store(q_ptr + out_base[:, None] + cols[None, :], q, mask=mask)

    @triton.jit
    def _int8_rows_kernel(x_ptr, inv_ptr, q_ptr, s_ptr, M, K, stride_xm,
                          HAS_SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                          SINGLE_PASS: tl.constexpr, P0: tl.constexpr = 0, P1: tl.constexpr = 0,
                          P2: tl.constexpr = 0):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        row_base = rows.to(tl.int64) * stride_xm
        out_base = rows.to(tl.int64) * K
        if SINGLE_PASS:  # the row in up to three power-of-two pieces, read once and kept in registers
            x0, m0, c0 = _load_piece(x_ptr, inv_ptr, row_base, rmask, 0, K, P0, HAS_SMOOTH)
            amax = tl.max(tl.abs(x0), axis=1)
            if P1 > 0:
                x1, m1, c1 = _load_piece(x_ptr, inv_ptr, row_base, rmask, P0, K, P1, HAS_SMOOTH)
                amax = tl.maximum(amax, tl.max(tl.abs(x1), axis=1))
            if P2 > 0:
                x2, m2, c2 = _load_piece(x_ptr, inv_ptr, row_base, rmask, P0 + P1, K, P2, HAS_SMOOTH)
                amax = tl.maximum(amax, tl.max(tl.abs(x2), axis=1))
            amax = tl.maximum(amax, 1e-12)
            rcp = tl.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), amax)
            _store_codes(q_ptr, out_base, x0, rcp, m0, c0)
            if P1 > 0:
                _store_codes(q_ptr, out_base, x1, rcp, m1, c1)
            if P2 > 0:
                _store_codes(q_ptr, out_base, x2, rcp, m2, c2)
        else:  # two passes over BLOCK_K chunks: row maximum, then codes (the second read mostly from L2)
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x, m, c = _load_piece(x_ptr, inv_ptr, row_base, rmask, k0, K, BLOCK_K, HAS_SMOOTH)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            amax = tl.maximum(amax, 1e-12)
            rcp = tl.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), amax)
            for k0 in range(0, K, BLOCK_K):
                x, m, c = _load_piece(x_ptr, inv_ptr, row_base, rmask, k0, K, BLOCK_K, HAS_SMOOTH)
                _store_codes(q_ptr, out_base, x, rcp, m, c)
        tl.store(s_ptr + rows, tl.div_rn(amax, 127.0), mask=rmask)


#: Rows up to this many elements can be read once and kept in registers (split into power-of-two pieces, so no
#: lane is padding).
SINGLE_PASS_MAX_K: Final = 16384
#: The automatic choice reads rows once only up to this width; wider rows take two passes, which the H200 run
#: of ``benchmarks/kernels/svdquant.py`` found faster at 8,960 and slower at 1,536 (``docs/performance.md``).
AUTO_SINGLE_PASS_MAX_K: Final = 4096
#: Rows per program are grouped until a program holds about this many elements.
TARGET_ELEMENTS_PER_PROGRAM: Final = 8192


def _launch_shape(k: int, single_pass: bool | None = None) -> dict[str, int | bool]:
    """Launch meta-parameters: ``BLOCK_M``, ``BLOCK_K``, ``SINGLE_PASS``, pieces ``P0..P2`` and ``num_warps``.

    Single pass (rows up to :data:`SINGLE_PASS_MAX_K` elements; the default on CUDA up to
    :data:`AUTO_SINGLE_PASS_MAX_K`): the row split into at
    most three power-of-two pieces (:func:`~worldfoundry.core.acceleration.kernels.fp8_rowwise_quant.row_pieces`:
    ``1536 = 1024 + 512``, ``8960 = 8192 + 512 + 256``), about 8K elements per program, 4 warps up to 10K
    elements per program (the layout the FP8 rowwise quantizer was tuned to on an H200). Otherwise two passes
    of 1,024-wide chunks over 8 rows.
    """
    if single_pass is None:
        single_pass = k <= AUTO_SINGLE_PASS_MAX_K and not interpreter_enabled()
    if single_pass and k <= SINGLE_PASS_MAX_K:
        p0, p1, p2 = row_pieces(k)
        width = p0 + p1 + p2
        block_m = 1 << (max(1, min(64, TARGET_ELEMENTS_PER_PROGRAM // width)).bit_length() - 1)
        warps = 4 if block_m * width <= 10240 else 8
        return {"BLOCK_M": block_m, "BLOCK_K": width, "SINGLE_PASS": True, "P0": p0, "P1": p1, "P2": p2,
                "num_warps": warps}
    padded = triton.next_power_of_2(k)
    if interpreter_enabled():
        return {"BLOCK_M": 4, "BLOCK_K": min(256, padded), "SINGLE_PASS": False, "num_warps": 4}
    return {"BLOCK_M": 8, "BLOCK_K": min(1024, padded), "SINGLE_PASS": False, "num_warps": 8}


def triton_quantize_rows_int8(x: torch.Tensor, inv_smooth: torch.Tensor | None = None, *,
                              single_pass: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton per-token INT8 quantization of ``x`` (``[..., K]``, rows contiguous).

    Args:
        x: bfloat16/float16/float32 tensor on CUDA (or CPU under ``TRITON_INTERPRET=1``).
        inv_smooth: optional float32 ``[K]`` on the same device.
        single_pass: force the one-read (``True``, rows up to :data:`SINGLE_PASS_MAX_K`) or two-pass (``False``)
            variant; ``None`` picks (both give the same bytes).

    Returns:
        ``(q int8 [M, K], scale float32 [M, 1])``, bitwise equal to the reference.

    Raises:
        QuantizationInputError: triton missing, unsupported dtype, or mismatched ``inv_smooth``.
    """
    if not TRITON_AVAILABLE:
        raise QuantizationInputError("triton is not importable; use the torch reference")
    if x.dtype not in _FLOAT_DTYPES or x.dim() < 1:
        raise QuantizationInputError(f"triton_quantize_rows_int8: unsupported input {x.dtype} {tuple(x.shape)}")
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if inv_smooth is not None and (inv_smooth.shape != (k,) or inv_smooth.dtype != torch.float32):
        raise QuantizationInputError(f"triton_quantize_rows_int8: inv_smooth must be float32 [{k}]")
    m = rows.shape[0]
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    meta = _launch_shape(k, single_pass)
    inv = inv_smooth if inv_smooth is not None else scale  # unused pointer when HAS_SMOOTH is False
    _int8_rows_kernel[(triton.cdiv(m, meta["BLOCK_M"]),)](
        rows, inv, q, scale, m, k, rows.stride(0), HAS_SMOOTH=inv_smooth is not None, **meta,
        enable_fp_fusion=False,  # x * rcp must round before the rounding addition (no FMA)
    )
    return q, scale


__all__ = [
    "INT8_AMAX_FLOOR",
    "TRITON_AVAILABLE",
    "interpreter_enabled",
    "reference_quantize_rows_int8",
    "triton_quantize_rows_int8",
]
