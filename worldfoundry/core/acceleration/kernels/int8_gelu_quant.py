"""The INT8 producer of a down projection fed by a GELU: GELU, smoothing, per-token INT8 and the low-rank down
projection in one kernel (Triton), for ``svdquant``'s ``w4a8`` backend.

In a diffusers ``FeedForward`` the down projection's input is ``g = GELU(h)`` of the up projection's bfloat16
output ``h``. Run per Linear, that costs a GELU kernel (read ``h``, write ``g``), the quantizer (read ``g``, write
codes) and the low-rank GEMM (read ``g`` again). This kernel reads ``h`` and writes only the codes, the row scales
and ``t``. One program of ``BLOCK_M`` rows makes two passes over ``BLOCK_K`` chunks:

1. ``g = bf16(gelu_f32(h))``; the row maximum of ``float32(g) * inv_smooth`` and ``t += g @ D.T`` (float32
   accumulation);
2. ``g`` again (the same instructions, the same bits), the codes ``clamp(round_half_even(ĝ * (127 / a)), ±127)``.

**Single pass with the row maxima given** (``row_max``, unsmoothed down projections only): when the up
projection's GEMM already merged each row's largest output ``hmax`` (floored at 0) into ``row_max``
(:func:`~worldfoundry.core.acceleration.kernels.w4a8_gluon_persistent.gluon_w4a8_persistent_gemm`'s ``row_max``),
the row magnitude is known before the row is read: ``a = max(GELU(hmax), GELU_NEGATIVE_BOUND)``. GELU rises on
``x > 0``, so its largest positive value in the row is ``GELU(hmax)``; on ``x < 0`` it never falls below
``-0.1700`` (bfloat16 ``-0.1699``; the bound, ``0.171875``, is above that even with this kernel's approximation).
So ``|g| <= a`` for every element, and the codes ``clamp(round_half_even(g * (127 / a)), ±127)`` need one read
of ``h`` instead of two. ``a`` equals the measured maximum except for rows whose every value is below about
``0.28``, which get the slightly coarser scale ``0.171875 / 127``; an element that rounds one bfloat16 step above
``GELU(hmax)`` (the kernel's GELU is approximate) clamps to ±127.

The GELU is the one of :mod:`~worldfoundry.core.acceleration.kernels.fp8_gelu_quant` (the same Triton function):
within ``2**-8 * |gelu(x)| + 2**-20 * |x|`` of the float64 formula, equal to torch's bfloat16 GELU for most but
not all elements. Given that activation, the codes and scales are **bitwise**
:func:`~worldfoundry.core.acceleration.quantization.int8_activation.quantize_rows_int8`'s, and ``t`` is within one
bfloat16 ulp of its largest magnitude of ``bf16(g @ D.T)`` (tests check both on the activation the FP8 producer
returns with ``return_activation=True``). :func:`reference_gelu_quantize_rows_int8_lowrank` is the torch
reference of the function the kernel approximates (torch's GELU, then the reference quantizer).

Example (CPU, with ``TRITON_INTERPRET=1`` set before triton is imported)::

    h = torch.randn(4, 128).to(torch.bfloat16)
    q, scale, t = triton_gelu_quantize_rows_int8_lowrank(h, "tanh", None, torch.zeros(16, 128, dtype=torch.bfloat16))
"""

from __future__ import annotations

from typing import Final

import torch
import torch.nn.functional as F

from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import _KERNEL_ARGS, check_approximate
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry.core.acceleration.kernels.int8_quant_lowrank import check_quant_lowrank_operands
from worldfoundry.core.acceleration.quantization.int8_activation import quantize_rows_int8, quantize_rows_int8_with_max
from worldfoundry.errors import QuantizationInputError

#: Rows per program, chunk width and warps on CUDA: the fastest launch shape at both W81 widths in the H200 grid
#: of ``benchmarks/kernels/int8_lowrank_check.py`` (0.168 ms at K 1,536, 0.776 ms at 8,960; every shape of that
#: grid equal across repeats).
DEFAULT_BLOCK_M: Final = 16
DEFAULT_BLOCK_K: Final = 128
DEFAULT_WARPS: Final = 4
#: ``|GELU(x)|`` for ``x < 0`` is at most 0.17004 (tanh form; 0.16997 exact), 0.1699 in bfloat16, and at most
#: 0.1709 with the kernel's approximation (within ``2**-8`` relative): a bfloat16 number above all of them.
GELU_NEGATIVE_BOUND: Final = 0.171875
#: Launch shape of the single pass with given row maxima (rows, chunk width, warps): the fastest at K 8,960 in the
#: H200 grid of ``benchmarks/kernels/int8_lowrank_check.py --kernels gelu_single_pass`` (0.511 ms; 0.135 ms at
#: K 1,536; every shape of that grid bitwise and equal across repeats).
GIVEN_MAX_BLOCK_M: Final = 64
GIVEN_MAX_BLOCK_K: Final = 128
GIVEN_MAX_WARPS: Final = 8

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import _gelu_to_bfloat16
    from worldfoundry.core.acceleration.kernels.int8_act_quant import _store_codes

    @triton.jit
    def _gelu_chunk(h_ptr, inv_ptr, row_base, rmask, start, K, c0, c1, WIDTH: tl.constexpr,
                    HAS_SMOOTH: tl.constexpr, ACTIVATION: tl.constexpr, PORTABLE_MATH: tl.constexpr,
                    SOFTWARE_ROUNDING: tl.constexpr):
        """Columns ``start .. start + WIDTH``: the GELU (float32 on the bfloat16 grid), its smoothed product, the
        mask and the columns (masked lanes are 0: GELU(0) = 0)."""
        cols = start + tl.arange(0, WIDTH)
        cmask = cols < K
        mask = rmask[:, None] & cmask[None, :]
        h = tl.load(h_ptr + row_base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = _gelu_to_bfloat16(h, c0, c1, ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING)
        xs = g
        if HAS_SMOOTH:
            xs = g * tl.load(inv_ptr + cols, mask=cmask, other=0.0)[None, :]
        return g, xs, mask, cols

    @triton.jit
    def _gelu_int8_lowrank_kernel(h_ptr, inv_ptr, d_ptr, q_ptr, s_ptr, t_ptr, M, K, stride_hm, c0, c1,
                                  RANK: tl.constexpr, HAS_SMOOTH: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_K: tl.constexpr, WIDEN: tl.constexpr, ACTIVATION: tl.constexpr,
                                  PORTABLE_MATH: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        row_base = rows.to(tl.int64) * stride_hm
        out_base = rows.to(tl.int64) * K
        r = tl.arange(0, RANK)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        t = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            g, xs, m, cols = _gelu_chunk(h_ptr, inv_ptr, row_base, rmask, k0, K, c0, c1, BLOCK_K, HAS_SMOOTH,
                                         ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING)
            amax = tl.maximum(amax, tl.max(tl.abs(xs), axis=1))
            d = tl.load(d_ptr + r[None, :].to(tl.int64) * K + cols[:, None], mask=(cols < K)[:, None], other=0.0)
            if WIDEN:  # the interpreter multiplies bfloat16 wrongly: widen (exact; g is on the bfloat16 grid)
                t = tl.dot(g, d.to(tl.float32), t)
            else:
                t = tl.dot(g.to(tl.bfloat16), d, t)
        amax = tl.maximum(amax, 1e-12)
        rcp = tl.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), amax)
        for k0 in range(0, K, BLOCK_K):
            g, xs, m, cols = _gelu_chunk(h_ptr, inv_ptr, row_base, rmask, k0, K, c0, c1, BLOCK_K, HAS_SMOOTH,
                                         ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING)
            _store_codes(q_ptr, out_base, xs, rcp, m, cols)
        tl.store(s_ptr + rows, tl.div_rn(amax, 127.0), mask=rmask)
        t_ptrs = t_ptr + rows.to(tl.int64)[:, None] * RANK + r[None, :]
        tl.store(t_ptrs, t.to(tl.bfloat16), mask=rmask[:, None])


    @triton.jit
    def _store_codes_below_127(q_ptr, out_base, g, rcp, mask, cols):
        """The codes of :func:`~.int8_act_quant._store_codes` where ``g * rcp > -127`` is known: only the upper
        clamp (``g >= -0.1709 > -a`` for every element, since ``a >= GELU_NEGATIVE_BOUND``)."""
        y = tl.minimum(g * rcp[:, None], 127.0)
        q = (y + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)
        tl.store(q_ptr + out_base[:, None] + cols[None, :], q, mask=mask)

    @triton.jit
    def _gelu_int8_given_max_kernel(h_ptr, rm_ptr, d_ptr, q_ptr, s_ptr, t_ptr, M, K, stride_hm, c0, c1, neg_bound,
                                    RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                                    WIDEN: tl.constexpr, ACTIVATION: tl.constexpr, PORTABLE_MATH: tl.constexpr,
                                    SOFTWARE_ROUNDING: tl.constexpr, EVEN_K: tl.constexpr,
                                    PACKED_ROUNDING: tl.constexpr = False):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        # loads read the last row again past M (no predicated loads); stores are masked by row
        row_base = tl.minimum(rows, M - 1).to(tl.int64) * stride_hm
        out_base = rows.to(tl.int64) * K
        r = tl.arange(0, RANK)
        top = tl.load(rm_ptr + rows, mask=rmask, other=0.0)
        amax = tl.maximum(_gelu_to_bfloat16(top, c0, c1, ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING), neg_bound)
        rcp = tl.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), amax)
        t = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:  # every chunk full: unmasked loads
                h = tl.load(h_ptr + row_base[:, None] + cols[None, :]).to(tl.float32)
                d = tl.load(d_ptr + r[None, :].to(tl.int64) * K + cols[:, None])
                m = rmask[:, None]
            else:
                m = rmask[:, None] & (cols < K)[None, :]
                h = tl.load(h_ptr + row_base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
                d = tl.load(d_ptr + r[None, :].to(tl.int64) * K + cols[:, None], mask=(cols < K)[:, None],
                            other=0.0)
            # no -0.0 saturation: below it |g| < 2**-26 |h|, whose code is 0 either way
            g = _gelu_to_bfloat16(h, c0, c1, ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING, False, PACKED_ROUNDING)
            if WIDEN:  # the interpreter multiplies bfloat16 wrongly: widen (exact; g is on the bfloat16 grid)
                t = tl.dot(g, d.to(tl.float32), t)
            else:
                t = tl.dot(g.to(tl.bfloat16), d, t)
            _store_codes_below_127(q_ptr, out_base, g, rcp, m, cols)
        tl.store(s_ptr + rows, tl.div_rn(amax, 127.0), mask=rmask)
        t_ptrs = t_ptr + rows.to(tl.int64)[:, None] * RANK + r[None, :]
        tl.store(t_ptrs, t.to(tl.bfloat16), mask=rmask[:, None])


def given_row_magnitudes(row_max: torch.Tensor, approximate: str) -> torch.Tensor:
    """Torch reference of the single pass's row magnitudes: ``max(bf16 GELU(row_max), GELU_NEGATIVE_BOUND)``,
    float32 ``[M, 1]`` (``row_max`` holds bfloat16 values: the up projection's row maxima)."""
    top = F.gelu(row_max.to(torch.bfloat16), approximate=check_approximate(approximate)).float()
    return top.clamp_min(GELU_NEGATIVE_BOUND).reshape(-1, 1)


def reference_gelu_quantize_rows_int8_lowrank(h: torch.Tensor, approximate: str, inv_smooth: torch.Tensor | None,
                                              lora_down: torch.Tensor | None, row_max: torch.Tensor | None = None
                                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Torch reference: ``g = F.gelu(h, approximate)`` (the dense model's activation), the reference quantizer's
    codes and scales of ``g`` (with ``row_max``: against :func:`given_row_magnitudes`, no smoothing), and
    ``t = bf16(g) @ D.T`` (``None`` without a down factor)."""
    g = F.gelu(h, approximate=check_approximate(approximate))
    if row_max is None:
        q, scale = quantize_rows_int8(g, inv_smooth)
    else:
        _check_given_max(row_max, inv_smooth, g.reshape(-1, g.shape[-1]).shape[0])
        q, scale = quantize_rows_int8_with_max(g.reshape(-1, g.shape[-1]).float(),
                                               given_row_magnitudes(row_max, approximate))
    rows = g.reshape(-1, g.shape[-1])
    t = None if lora_down is None else F.linear(rows.to(lora_down.dtype), lora_down)
    return q, scale, t


def _check_given_max(row_max: torch.Tensor | None, inv_smooth: torch.Tensor | None, m: int) -> None:
    if row_max is None:
        return
    if inv_smooth is not None:
        raise QuantizationInputError("gelu_quantize_rows_int8_lowrank: row_max needs an unsmoothed down projection "
                                     "(a smoothed row's maximum is not GELU of the up projection's maximum); "
                                     "pass row_max=None")
    if not isinstance(row_max, torch.Tensor) or row_max.dtype != torch.float32 or tuple(row_max.shape) != (m,) \
            or not row_max.is_contiguous():
        raise QuantizationInputError(f"gelu_quantize_rows_int8_lowrank: row_max must be a contiguous float32 [{m}] "
                                     f"tensor, got {getattr(row_max, 'dtype', type(row_max))} "
                                     f"{tuple(getattr(row_max, 'shape', ()))}")


def _launch_given_max(h: torch.Tensor, row_max: torch.Tensor, lora_down: torch.Tensor, outs: tuple,
                      act: tuple, interp: bool, launch: dict) -> None:
    """The single pass with given row maxima (launch values ``None``: this kernel's defaults)."""
    (q, scale, t), (activation, c0, c1) = outs, act
    m, k = h.shape
    if launch["packed_rounding"] is None:  # the default: on CUDA (inline PTX)
        launch = dict(launch, packed_rounding=not interp and h.device.type == "cuda")
    if launch["packed_rounding"] and (interp or h.device.type != "cuda"):
        raise QuantizationInputError("gelu_quantize_rows_int8_lowrank: packed_rounding is inline PTX; it needs a "
                                     "CUDA device without TRITON_INTERPRET")
    bm = launch["block_m"] or (16 if interp else GIVEN_MAX_BLOCK_M)
    portable, software = launch["portable_math"], launch["software_rounding"]
    bk = launch["block_k"] or (64 if interp else GIVEN_MAX_BLOCK_K)
    _gelu_int8_given_max_kernel[(triton.cdiv(m, bm),)](
        h, row_max, lora_down, q, scale, t, m, k, h.stride(0), c0, c1, GELU_NEGATIVE_BOUND, RANK=lora_down.shape[0],
        BLOCK_M=bm, BLOCK_K=bk, EVEN_K=k % bk == 0, WIDEN=h.device.type != "cuda",
        ACTIVATION=activation, PORTABLE_MATH=interp if portable is None else portable,
        SOFTWARE_ROUNDING=interp if software is None else software,
        num_warps=launch["num_warps"] or (4 if interp else GIVEN_MAX_WARPS), PACKED_ROUNDING=launch["packed_rounding"],
        enable_fp_fusion=False,  # g * rcp must round before the rounding addition (no FMA)
    )


def triton_gelu_quantize_rows_int8_lowrank(h: torch.Tensor, approximate: str, inv_smooth: torch.Tensor | None,
                                           lora_down: torch.Tensor, *, row_max: torch.Tensor | None = None,
                                           block_m: int | None = None, block_k: int | None = None,
                                           num_warps: int | None = None, portable_math: bool | None = None,
                                           software_rounding: bool | None = None, packed_rounding: bool | None = None
                                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GELU + smoothing + per-token INT8 codes and ``t = bf16(GELU(h)) @ D.T`` of ``h`` in one kernel.

    Args:
        h: bfloat16 ``[M, K]`` (the up projection's output), unit stride along K, on CUDA (or the CPU under
            ``TRITON_INTERPRET=1``).
        approximate: ``"tanh"`` or ``"none"``, as ``torch.nn.functional.gelu``.
        inv_smooth: optional float32 ``[K]`` (the down projection's ``1/λ``).
        lora_down: bfloat16 ``[r, K]``, ``r`` a power of two >= 16 (rank padded).
        row_max: optional float32 ``[M]``, each row's largest ``h`` floored at 0 (the up projection's GEMM
            writes it): one pass over ``h`` with the row magnitudes of :func:`given_row_magnitudes` (the module
            docstring); needs ``inv_smooth=None``. Launch shape :data:`GIVEN_MAX_BLOCK_M` etc.
        block_m / block_k / num_warps: launch shape (defaults :data:`DEFAULT_BLOCK_M`, :data:`DEFAULT_BLOCK_K`,
            :data:`DEFAULT_WARPS`; 16 / 64 / 4 under the interpreter).
        portable_math / software_rounding: tanh/erf without libdevice, bfloat16 rounding in bit arithmetic
            (default: only under the interpreter, as the FP8 producer); packed_rounding: with ``row_max`` on CUDA,
            two elements per bfloat16 conversion (the same values; the default there, ``None``: 1.061 against
            1.238 ms on an H200 at W81; ``True`` elsewhere is an error).

    Returns ``(q int8 [M, K], scale float32 [M, 1], t bfloat16 [M, r])``.

    Raises:
        QuantizationInputError: triton missing, ``h`` not bfloat16, operands of the wrong shape, unsupported
            ``approximate``, or a CPU tensor without the interpreter.
    """
    if not isinstance(h, torch.Tensor) or h.dtype != torch.bfloat16 or h.dim() != 2:
        raise QuantizationInputError(f"gelu_quantize_rows_int8_lowrank: h must be bfloat16 [M, K] (the up "
                                     f"projection's output), got {getattr(h, 'dtype', type(h))} "
                                     f"{tuple(getattr(h, 'shape', ()))}")
    activation, (c0, c1) = _KERNEL_ARGS[check_approximate(approximate)]
    m, k, rank = check_quant_lowrank_operands(h, inv_smooth, lora_down)
    interp = interpreter_enabled()
    if h.device.type != "cuda" and not interp:
        raise QuantizationInputError(f"gelu_quantize_rows_int8_lowrank: tensor on {h.device}; the kernel needs a "
                                     "CUDA device (or TRITON_INTERPRET=1 for CPU tests)")
    q, scale, t = (torch.empty((m, n), dtype=dt, device=h.device)
                   for n, dt in ((k, torch.int8), (1, torch.float32), (rank, torch.bfloat16)))
    _check_given_max(row_max, inv_smooth, m)
    if row_max is not None and m:
        _launch_given_max(h, row_max, lora_down, (q, scale, t), (activation, c0, c1), interp, dict(
            block_m=block_m, block_k=block_k, num_warps=num_warps, portable_math=portable_math,
            software_rounding=software_rounding, packed_rounding=packed_rounding))
    if row_max is not None or m == 0:
        return q, scale, t
    bm = block_m or (16 if interp else DEFAULT_BLOCK_M)
    _gelu_int8_lowrank_kernel[(triton.cdiv(m, bm),)](
        h, inv_smooth if inv_smooth is not None else scale, lora_down, q, scale, t, m, k, h.stride(0), c0, c1,
        RANK=rank, HAS_SMOOTH=inv_smooth is not None, BLOCK_M=bm,
        BLOCK_K=block_k or (64 if interp else DEFAULT_BLOCK_K), WIDEN=h.device.type != "cuda",
        ACTIVATION=activation, PORTABLE_MATH=interp if portable_math is None else portable_math,
        SOFTWARE_ROUNDING=interp if software_rounding is None else software_rounding,
        num_warps=num_warps or (4 if interp else DEFAULT_WARPS),
        enable_fp_fusion=False,  # g * rcp must round before the rounding addition (no FMA)
    )
    return q, scale, t


__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_M", "DEFAULT_WARPS", "GELU_NEGATIVE_BOUND", "GIVEN_MAX_BLOCK_K",
           "GIVEN_MAX_BLOCK_M", "GIVEN_MAX_WARPS", "given_row_magnitudes", "reference_gelu_quantize_rows_int8_lowrank",
           "triton_gelu_quantize_rows_int8_lowrank"]
