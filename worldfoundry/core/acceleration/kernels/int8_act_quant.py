"""Per-token INT8 activation quantization with smoothing (Triton), beside its torch reference.

:func:`triton_quantize_rows_int8` computes exactly
:func:`~worldfoundry.core.acceleration.quantization.int8_activation.quantize_rows_int8` (re-exported here as
:func:`reference_quantize_rows_int8`): the same float32 product ``x * inv_smooth``, the same row maximum, the
same IEEE divisions ``a / 127`` and ``127 / a`` (``tl.div_rn``, once per row), one rounded product per element
and round-half-to-even. Codes and scales are bitwise equal to the reference for every finite input.

Rounding to the nearest integer uses the float32 identity ``(y + 1.5 * 2**23) - 1.5 * 2**23`` (exact
round-half-to-even for ``|y| < 2**22``; here ``|y| <= 127``), which the Triton interpreter also runs (it has no
``rint``).

Rows of up to 4,096 (padded) elements are read once and kept in registers (``SINGLE_PASS``, forced up to
16,384); longer rows are read twice in 1,024-wide chunks (row maximum, then quantize). Both give the same
bytes.

Example (CPU, with ``TRITON_INTERPRET=1`` set before triton is imported)::

    q, scale = triton_quantize_rows_int8(torch.randn(4, 64), inv_smooth=None)
"""

from __future__ import annotations

import os
from typing import Final

import torch

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
    def _int8_rows_kernel(x_ptr, inv_ptr, q_ptr, s_ptr, M, K, stride_xm,
                          HAS_SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                          SINGLE_PASS: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        row_base = rows.to(tl.int64) * stride_xm
        if SINGLE_PASS:  # the whole row (BLOCK_K >= K) read once and kept in registers
            cols = tl.arange(0, BLOCK_K)
            cmask = cols < K
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + row_base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_SMOOTH:
                x = x * tl.load(inv_ptr + cols, mask=cmask, other=0.0)[None, :]
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
            rcp = tl.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), amax)
            y = x * rcp[:, None]
            y = (y + 12582912.0) - 12582912.0
            y = tl.minimum(tl.maximum(y, -127.0), 127.0)
            tl.store(q_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], y.to(tl.int8), mask=mask)
            tl.store(s_ptr + rows, tl.div_rn(amax, 127.0), mask=rmask)
        else:
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < K
                mask = rmask[:, None] & cmask[None, :]
                x = tl.load(x_ptr + row_base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_SMOOTH:
                    x = x * tl.load(inv_ptr + cols, mask=cmask, other=0.0)[None, :]
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            amax = tl.maximum(amax, 1e-12)
            scale = tl.div_rn(amax, 127.0)
            rcp = tl.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), amax)
            out_base = rows.to(tl.int64) * K
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < K
                mask = rmask[:, None] & cmask[None, :]
                x = tl.load(x_ptr + row_base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_SMOOTH:
                    x = x * tl.load(inv_ptr + cols, mask=cmask, other=0.0)[None, :]
                y = x * rcp[:, None]
                y = (y + 12582912.0) - 12582912.0
                y = tl.minimum(tl.maximum(y, -127.0), 127.0)
                tl.store(q_ptr + out_base[:, None] + cols[None, :], y.to(tl.int8), mask=mask)
            tl.store(s_ptr + rows, scale, mask=rmask)


#: Rows up to this many (power-of-two padded) elements are read once and kept in registers by default
#: (an 8,960-wide row padded to 16,384 lanes single-pass measured 0.72 ms at 32,760 rows on an H200, far from the
#: memory bound; longer rows take the two-pass path, whose second read mostly hits L2).
SINGLE_PASS_MAX_K: Final = 4096
#: Largest row (padded) the single-pass variant accepts when forced.
SINGLE_PASS_LIMIT: Final = 16384


def _launch_shape(k: int, single_pass: bool | None = None) -> tuple[int, int, int, bool]:
    """``(BLOCK_M, BLOCK_K, num_warps, single_pass)``.

    Single pass (rows up to :data:`SINGLE_PASS_MAX_K` padded elements): one read of each row, about 8K
    elements per program (an 8,960-wide row is padded to 16,384 lanes; masked lanes cost no memory traffic,
    which bounds this kernel). Otherwise two passes of 1,024-wide chunks over 8 rows.
    """
    padded = triton.next_power_of_2(k)
    if single_pass is None:
        single_pass = padded <= SINGLE_PASS_MAX_K and not interpreter_enabled()
    single_pass = single_pass and padded <= SINGLE_PASS_LIMIT
    if single_pass:
        block_m = max(1, min(16, 8192 // padded))
        return block_m, padded, 8 if padded * block_m >= 8192 else 4, True
    if interpreter_enabled():
        return 4, min(256, padded), 4, False
    return 8, min(1024, padded), 8, False


def triton_quantize_rows_int8(x: torch.Tensor, inv_smooth: torch.Tensor | None = None, *,
                              single_pass: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton per-token INT8 quantization of ``x`` (``[..., K]``, rows contiguous).

    Args:
        x: bfloat16/float16/float32 tensor on CUDA (or CPU under ``TRITON_INTERPRET=1``).
        inv_smooth: optional float32 ``[K]`` on the same device.
        single_pass: force the one-read (``True``) or two-pass (``False``) variant; ``None`` picks (both give
            the same bytes).

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
    block_m, block_k, warps, single = _launch_shape(k, single_pass)
    inv = inv_smooth if inv_smooth is not None else scale  # unused pointer when HAS_SMOOTH is False
    _int8_rows_kernel[(triton.cdiv(m, block_m),)](
        rows, inv, q, scale, m, k, rows.stride(0),
        HAS_SMOOTH=inv_smooth is not None, BLOCK_M=block_m, BLOCK_K=block_k, SINGLE_PASS=single, num_warps=warps,
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
