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

Row layout: a row of ``K`` elements is split into at most three power-of-two pieces (``1536 = 1024 + 512``,
``8960 = 8192 + 512 + 256``) instead of one block padded to the next power of two, so no lane loads, computes
or stores padding (padding 8,960 to 16,384 wasted 45 % of the lanes). Narrow rows are grouped, several rows
per program (:data:`TARGET_ELEMENTS_PER_PROGRAM`). Rows of up to :data:`SINGLE_PASS_MAX_K` elements are read
once and kept in registers; longer rows are read twice (amax pass, then quantize pass), the second read mostly
served from L2. Grouping and splitting never change the result: the row maximum is exact in any order and every
other step is per element.

The same kernel can apply a producer activation first (``ACTIVATION``): GELU computed once per element in
float32, rounded to bfloat16 and kept in registers between the row amax and the cast (single pass), then
quantized. Its GELU is within a stated bound of the float64 formula but not bitwise torch's (see
:mod:`worldfoundry.core.acceleration.kernels.fp8_gelu_quant`, which holds the fused producer and its reference).

Optionally the kernel adds the number of clipped elements (``|x * (1 / scale)| >= 464`` or non-finite: with
dynamic per-row scaling only non-finite inputs clip) to an int32 counter on the device, with one atomic per
program and only when the program saw a clipped element.

Example (CPU, with ``TRITON_INTERPRET=1`` set before triton is imported)::

    q, scale = triton_quantize_rowwise_fp8(torch.randn(4, 64))
"""

from __future__ import annotations

import functools
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
from worldfoundry.core.acceleration.quantization.fp8 import (
    quantize_rowwise_fp8 as reference_quantize_rowwise_fp8,
)
from worldfoundry.core.fusion.launch import KernelLauncher
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
#: Narrow rows are grouped until a program holds about this many elements (a power-of-two number of rows).
TARGET_ELEMENTS_PER_PROGRAM: Final = 8192
#: Plain quantization uses 4 warps up to this many elements per program (at most 80 per thread), else 8.
PLAIN_FOUR_WARP_MAX_ELEMENTS: Final = 10240
#: Narrowest row piece (narrower rows are padded to it).
MIN_PIECE: Final = 16
#: ``ACTIVATION`` codes of the kernel: none (plain quantization), GELU tanh approximation, exact (erf) GELU.
ACTIVATION_NONE: Final = 0
ACTIVATION_GELU_TANH: Final = 1
ACTIVATION_GELU_ERF: Final = 2

if TRITON_AVAILABLE:
    try:  # the backend-neutral module, resolved to CUDA's libdevice when compiling for NVIDIA GPUs
        from triton.language.extra import libdevice
    except ImportError:  # pragma: no cover - older triton layouts
        from triton.language.extra.cuda import libdevice

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
    def _round_to_bfloat16_grid(y):
        """Round finite float32 ``y`` to the nearest bfloat16 value (ties to even), kept in float32."""
        bits = y.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return rounded.to(tl.float32, bitcast=True)

    @triton.jit
    def _round_to_bfloat16_packed(y):
        """``y`` rounded to bfloat16 (ties to even) two elements per ``cvt.rn.bf16x2.f32``, widened back to float32
        (exact). The paired conversion runs off the SM's quarter-rate conversion unit, which the one-element form
        uses. CUDA only (inline PTX)."""
        b = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [y], dtype=tl.bfloat16,
                                      is_pure=True, pack=2)
        return b.to(tl.float32)

    @triton.jit
    def _gelu_to_bfloat16(x, c0, c1, ACTIVATION: tl.constexpr, PORTABLE_MATH: tl.constexpr,
                          SOFTWARE_ROUNDING: tl.constexpr, SATURATE: tl.constexpr = True,
                          PACKED_ROUNDING: tl.constexpr = False):
        """GELU of float32 ``x`` in float32, rounded to bfloat16 and returned as float32.

        ``SATURATE=False`` leaves out the ``-0.0`` below ``z >= Z_SAT`` (there ``|y| < 2**-26 |x|``, which a
        per-row INT8 code rounds to 0 anyway); ``PACKED_ROUNDING`` rounds two elements per conversion
        (:func:`_round_to_bfloat16_packed`, CUDA only).

        Tanh (``c0``, ``c1`` = :data:`GELU_TANH_EXP2_A`, ``_B``): ``0.5 * x * (1 + tanh(u))`` is evaluated as
        ``x / (1 + 2**z)`` with ``z = x * (c0 + c1 * x * x) = -2 * u * log2(e)`` -- one ``ex2`` and one
        reciprocal instead of libdevice's ``tanhf`` (about 20 instructions), and without the cancellation in
        ``1 + tanh(u)`` for negative ``x``. Where ``tanhf(u)`` rounds to -1 (``z >= Z_SAT``) the result is
        ``-0.0``, as torch's formula gives there. Erf (``c0`` = 1/sqrt(2)): ``(x * 0.5) * (1 + erff(x * c0))``.
        """
        if ACTIVATION == 1:
            z = x * tl.fma(c1, x * x, c0)
            if PORTABLE_MATH:
                y = x / (1.0 + tl.exp2(z))
            else:
                y = libdevice.fast_dividef(x, 1.0 + tl.exp2(z))
            if SATURATE:
                y = tl.where(z >= 26.0, -0.0, y)  # tanhf(u) == -1 for u <= -9.0109 (z = -2u log2 e >= 26.0)
        else:
            z = x * c0
            if PORTABLE_MATH:
                e = tl.erf(z)
            else:
                e = libdevice.erf(z)
            y = (x * 0.5) * (1.0 + e)
        if SOFTWARE_ROUNDING:
            y = _round_to_bfloat16_grid(y)
        elif PACKED_ROUNDING:
            y = _round_to_bfloat16_packed(y)
        else:
            y = y.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
        return y

    @triton.jit
    def _load_rows(x_rows, row_mask, col0, K, c0, c1, WIDTH: tl.constexpr, ACTIVATION: tl.constexpr,
                   PORTABLE_MATH: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, smooth_ptr=None,
                   HAS_SMOOTH: tl.constexpr = False):
        """Columns ``[col0, col0 + WIDTH)`` of the program's rows as float32 (after the activation, if any, then
        times the per-column ``smooth`` factor: one rounded float32 product)."""
        cols = col0 + tl.arange(0, WIDTH)
        cmask = cols < K
        mask = row_mask[:, None] & cmask[None, :]
        v = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ACTIVATION != 0:
            v = _gelu_to_bfloat16(v, c0, c1, ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING)
        if HAS_SMOOTH:
            v = v * tl.load(smooth_ptr + cols, mask=cmask, other=0.0)[None, :]
        return v, mask, cols

    @triton.jit
    def _store_rows(v, inv, q_rows, a_rows, cols, mask, fp8_max, clip_threshold, COUNT_CLIPS: tl.constexpr,
                    STORE_ACTIVATION: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
        """Quantize ``v`` with the per-row reciprocals ``inv`` and store it; returns clipped elements per row."""
        if STORE_ACTIVATION:
            tl.store(a_rows + cols[None, :], v.to(tl.bfloat16), mask=mask)
        y = v * inv[:, None]
        if COUNT_CLIPS:
            clipped = tl.sum(tl.where(tl.abs(y) < clip_threshold, 0, 1), axis=1)
        else:
            clipped = tl.zeros([v.shape[0]], dtype=tl.int32)
        if SOFTWARE_ROUNDING:
            y = _round_to_e4m3_grid(tl.minimum(tl.maximum(y, -fp8_max), fp8_max))
        # else: the hardware cast (cvt.rn.satfinite) saturates to +-448 itself, like the reference's clamp
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        tl.store(q_rows + cols[None, :], q, mask=mask)
        return clipped

    @triton.jit
    def row_scales(x_rows, row_mask, K, c0, c1, fp8_max, amax_floor, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   ACTIVATION: tl.constexpr, PORTABLE_MATH: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
                   smooth_ptr=None, HAS_SMOOTH: tl.constexpr = False):
        """One pass over the rows in ``BLOCK_K`` columns: ``(scale, 1 / scale)`` per row, ``scale = max|v| / 448``
        of the (activated, smoothed) values, floored."""
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            v, m, kk = _load_rows(x_rows, row_mask, k_start, K, c0, c1, BLOCK_K, ACTIVATION, PORTABLE_MATH,
                                  SOFTWARE_ROUNDING, smooth_ptr, HAS_SMOOTH)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        scale = tl.div_rn(tl.maximum(amax, amax_floor), fp8_max)
        return scale, tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), scale)

    @triton.jit
    def _fp8_rowwise_quant_kernel(
        x_ptr, q_ptr, scale_ptr, clip_ptr, act_ptr,
        M, K, stride_xm, stride_qm, stride_am,
        fp8_max, amax_floor, clip_threshold, c0, c1,
        BLOCK_M: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, BLOCK_K: tl.constexpr,
        SINGLE_PASS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_ACTIVATION: tl.constexpr,
        PORTABLE_MATH: tl.constexpr, COUNT_CLIPS: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
        smooth_ptr=None, HAS_SMOOTH: tl.constexpr = False,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        x_rows = x_ptr + rows64[:, None] * stride_xm
        q_rows = q_ptr + rows64[:, None] * stride_qm
        a_rows = act_ptr + rows64[:, None] * stride_am
        if SINGLE_PASS:
            # the row in up to three power-of-two pieces, all held in registers between amax and quantization
            v0, m0, k0 = _load_rows(x_rows, row_mask, 0, K, c0, c1, P0, ACTIVATION, PORTABLE_MATH, SOFTWARE_ROUNDING, smooth_ptr, HAS_SMOOTH)
            amax = tl.max(tl.abs(v0), axis=1)
            if P1 > 0:
                v1, m1, k1 = _load_rows(x_rows, row_mask, P0, K, c0, c1, P1, ACTIVATION, PORTABLE_MATH,
                                        SOFTWARE_ROUNDING, smooth_ptr, HAS_SMOOTH)
                amax = tl.maximum(amax, tl.max(tl.abs(v1), axis=1))
            if P2 > 0:
                v2, m2, k2 = _load_rows(x_rows, row_mask, P0 + P1, K, c0, c1, P2, ACTIVATION, PORTABLE_MATH,
                                        SOFTWARE_ROUNDING, smooth_ptr, HAS_SMOOTH)
                amax = tl.maximum(amax, tl.max(tl.abs(v2), axis=1))
            scale = tl.div_rn(tl.maximum(amax, amax_floor), fp8_max)
            inv = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), scale)
            clipped = _store_rows(v0, inv, q_rows, a_rows, k0, m0, fp8_max, clip_threshold, COUNT_CLIPS,
                                  STORE_ACTIVATION, SOFTWARE_ROUNDING)
            if P1 > 0:
                clipped += _store_rows(v1, inv, q_rows, a_rows, k1, m1, fp8_max, clip_threshold, COUNT_CLIPS,
                                       STORE_ACTIVATION, SOFTWARE_ROUNDING)
            if P2 > 0:
                clipped += _store_rows(v2, inv, q_rows, a_rows, k2, m2, fp8_max, clip_threshold, COUNT_CLIPS,
                                       STORE_ACTIVATION, SOFTWARE_ROUNDING)
        else:
            scale, inv = row_scales(x_rows, row_mask, K, c0, c1, fp8_max, amax_floor, BLOCK_M, BLOCK_K, ACTIVATION,
                                    PORTABLE_MATH, SOFTWARE_ROUNDING, smooth_ptr, HAS_SMOOTH)
            clipped = tl.zeros([BLOCK_M], dtype=tl.int32)
            for k_start in range(0, K, BLOCK_K):  # second read (L2); the activation is recomputed
                v, m, kk = _load_rows(x_rows, row_mask, k_start, K, c0, c1, BLOCK_K, ACTIVATION, PORTABLE_MATH,
                                      SOFTWARE_ROUNDING, smooth_ptr, HAS_SMOOTH)
                clipped += _store_rows(v, inv, q_rows, a_rows, kk, m, fp8_max, clip_threshold, COUNT_CLIPS,
                                       STORE_ACTIVATION, SOFTWARE_ROUNDING)
        tl.store(scale_ptr + rows64, scale, mask=row_mask)
        if COUNT_CLIPS:
            total = tl.sum(tl.where(row_mask, clipped, 0), axis=0)
            if total > 0:
                tl.atomic_add(clip_ptr, total)


def interpreter_enabled() -> bool:
    """Whether Triton runs in interpreter mode (``TRITON_INTERPRET=1``), which accepts CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _pow2_floor(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


def row_pieces(k: int) -> tuple[int, int, int]:
    """Split a row of ``k`` elements into at most three power-of-two pieces ``(P0, P1, P2)`` (0 = absent).

    ``P0`` and ``P1`` are the two largest powers of two that fit; ``P2`` covers the rest, padded to a power of
    two (masked); pieces are at least :data:`MIN_PIECE` wide. Rows narrower than 64 use one padded piece.

    Example:
        >>> row_pieces(1536), row_pieces(8960), row_pieces(100)
        ((1024, 512, 0), (8192, 512, 256), (64, 32, 16))
    """
    k = max(int(k), 1)
    if k < 64:
        return max(_pow2_ceil(k), MIN_PIECE), 0, 0
    p0 = _pow2_floor(k)
    rest = k - p0
    p1 = (_pow2_floor(rest) if rest >= MIN_PIECE else MIN_PIECE) if rest else 0
    rest = max(rest - p1, 0)
    p2 = max(_pow2_ceil(rest), MIN_PIECE) if rest else 0
    return p0, p1, p2


@functools.lru_cache(maxsize=256)
def _config(k: int, activation: int) -> tuple[int, int, int, int, int, bool, int]:
    """``(BLOCK_M, P0, P1, P2, BLOCK_K, SINGLE_PASS, num_warps)`` for rows of ``k`` elements."""
    single = k <= SINGLE_PASS_MAX_K
    if single:
        p0, p1, p2 = row_pieces(k)
        width = p0 + p1 + p2
    else:
        p0, p1, p2 = MULTI_PASS_BLOCK_K, 0, 0
        width = MULTI_PASS_BLOCK_K
    block_m = _pow2_floor(max(1, min(64, TARGET_ELEMENTS_PER_PROGRAM // width)))
    elements = block_m * width
    if activation == ACTIVATION_NONE:  # H200 sweep: 4 warps best at K=1536 (4 rows) and K=8960 (1 row)
        num_warps = 4 if elements <= PLAIN_FOUR_WARP_MAX_ELEMENTS else 8
    else:  # the activation's temporaries: about 35 elements per thread (~60 registers at K=8960)
        num_warps = 4 if elements <= 4096 else 8
    return block_m, p0, p1, p2, width, single, num_warps


def launch_config(k: int, activation: int = ACTIVATION_NONE) -> dict[str, Any]:
    """Block sizes and warps used for rows of ``k`` elements (shared by the launcher, tests and benchmarks).

    Args:
        k: elements per row.
        activation: one of the ``ACTIVATION_*`` codes (the same layout is used for every activation today).

    Returns:
        ``{"BLOCK_M", "PIECES", "BLOCK_K", "SINGLE_PASS", "num_warps"}``: rows per program, the row's pieces
        (single pass), the padded row width (single pass) or chunk width (two passes), the pass mode and warps.

    Raises:
        QuantizationInputError: triton is not importable.
    """
    if not TRITON_AVAILABLE:
        raise QuantizationInputError("triton is not installed; install the 'triton' extra or use the torch reference")
    block_m, p0, p1, p2, block_k, single, num_warps = _config(int(k), int(activation))
    return {"BLOCK_M": block_m, "PIECES": (p0, p1, p2) if single else (), "BLOCK_K": block_k,
            "SINGLE_PASS": single, "num_warps": num_warps}


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D ``[M, K]`` view (or copy) of ``x`` whose rows are evenly spaced and whose last stride is 1."""
    k = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    if rows.stride(-1) != 1 and rows.shape[-1] > 1:
        rows = rows.contiguous()
    return rows


def check_clip_counter(clip_counter: torch.Tensor | None, x: torch.Tensor) -> None:
    """Raise unless ``clip_counter`` is ``None`` or a one-element int32 tensor on ``x``'s device."""
    if clip_counter is not None and (
        clip_counter.dtype != torch.int32 or clip_counter.numel() != 1 or clip_counter.device != x.device
    ):
        raise QuantizationInputError("clip_counter must be a one-element int32 tensor on the input's device")


#: Launch plans by geometry and constexprs (:class:`~worldfoundry.core.fusion.launch.KernelLauncher`: after a
#: specialization's first launch, later ones call the compiled kernel's launcher directly, skipping Triton's
#: per-call argument binding -- tens of microseconds of host time per launch, two launches per FP8 FFN).
_PLANS: dict[tuple[Any, ...], KernelLauncher] = {}
_MAX_PLANS: Final = 256
#: Pointer arguments of the kernel (``x``, ``q``, ``scale``, the clip counter, the activation output).
_N_POINTERS: Final = 5


def _launch_on(device: torch.device, grid: tuple[int], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Launch the kernel with ``device`` current (a CUDA tensor on another than the current device).

    On the current CUDA device without a smoothing vector the launch goes through a cached launch plan (the
    same compiled kernel on the same arguments, so the same bytes; see :data:`_PLANS`); elsewhere, and under
    the interpreter, through Triton's normal path.
    """
    if device.type != "cuda" or "smooth_ptr" in kwargs:
        _fp8_rowwise_quant_kernel[grid](*args, **kwargs)
        return
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            _fp8_rowwise_quant_kernel[grid](*args, **kwargs)
        return
    # the plan fixes every pointer's dtype (its launcher keys only on the device and the alignments): the input's
    # is the one that varies (q, scale, the counter and the activation output follow from the constexprs)
    key = (args[0].dtype, grid, *args[_N_POINTERS:], *kwargs.values())
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = KernelLauncher(_fp8_rowwise_quant_kernel, grid, n_pointers=_N_POINTERS,
                                            fixed=args[_N_POINTERS:],
                                            constexprs={**kwargs, "smooth_ptr": None, "HAS_SMOOTH": False})
    plan(args[:_N_POINTERS])


def launch_rowwise_fp8(
    x: torch.Tensor,
    *,
    activation: int = ACTIVATION_NONE,
    constants: tuple[float, float] = (0.0, 0.0),
    clip_counter: torch.Tensor | None = None,
    software_rounding: bool | None = None,
    portable_math: bool | None = None,
    store_activation: bool = False,
    config: dict[str, Any] | None = None,
    inv_smooth: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the kernel on already validated input (callers check dtype, device and the counter).

    Args:
        x: ``[..., K]`` input on a CUDA device (or the CPU under the interpreter).
        activation: ``ACTIVATION_*`` code applied before quantization.
        constants: the activation's float32 constants ``(c0, c1)`` (see ``_gelu_to_bfloat16``).
        clip_counter: optional one-element int32 device counter.
        software_rounding: explicit bfloat16/e4m3 rounding in bit arithmetic (default: only under the
            interpreter).
        portable_math: tanh/erf without libdevice (default: only under the interpreter, which has none).
        store_activation: also return the activation output (bfloat16; for tests and benchmarks).
        config: benchmark override (:func:`_overridden`); the result does not depend on it.
        inv_smooth: optional float32 ``[K]`` multiplied into every column after the activation (``1 / λ``).
        q_out / scale_out: optional FP8 ``[M, >= K]`` and float32 ``[M, 1]`` buffers (codes fill ``:K``;
            returned as the ``[M, K]`` view of ``q_out``).

    Returns:
        ``(q, scale, activation_output_or_None)``.
    """
    interpreted = interpreter_enabled()
    shape = x.shape
    k = shape[-1]
    rows = _as_rows(x)
    m = rows.shape[0]
    q, scale = _out_buffers(q_out, scale_out, m, k, x.device)
    act = torch.empty((m, k), dtype=torch.bfloat16, device=x.device) if store_activation else None
    if m > 0:
        block_m, p0, p1, p2, block_k, single, num_warps = _overridden(_config(int(k), int(activation)), config)
        counter = clip_counter if clip_counter is not None else scale
        act_arg = act if act is not None else q
        args = (
            rows, q, scale, counter, act_arg, m, k, rows.stride(0), q.stride(0), act_arg.stride(0),
            FP8_E4M3_MAX, AMAX_FLOOR, CLIP_THRESHOLD, float(constants[0]), float(constants[1]),
        )
        kwargs = {
            "BLOCK_M": block_m, "P0": p0, "P1": p1, "P2": p2, "BLOCK_K": block_k, "SINGLE_PASS": single,
            "ACTIVATION": int(activation), "STORE_ACTIVATION": act is not None,
            "PORTABLE_MATH": interpreted if portable_math is None else bool(portable_math),
            "COUNT_CLIPS": clip_counter is not None,
            "SOFTWARE_ROUNDING": interpreted if software_rounding is None else bool(software_rounding),
            "num_warps": num_warps, **_smoothing(inv_smooth, k, x.device),
        }
        _launch_on(x.device, (triton.cdiv(m, block_m),), args, kwargs)
    if q_out is not None:
        return q[:, :k], scale, act
    return q.view(shape), scale.view(*shape[:-1], 1), act.view(shape) if act is not None else None


def _smoothing(inv_smooth: torch.Tensor | None, k: int, device: torch.device) -> dict[str, Any]:
    """The kernel arguments of the optional smoothing vector (checked: float32 ``[K]`` on ``device``)."""
    if inv_smooth is None:
        return {}
    if inv_smooth.shape != (k,) or inv_smooth.dtype != torch.float32 or inv_smooth.device != device:
        raise QuantizationInputError(f"launch_rowwise_fp8: inv_smooth must be float32 [{k}] on {device}")
    return {"smooth_ptr": inv_smooth, "HAS_SMOOTH": True}


def _overridden(chosen: tuple[int, int, int, int, int, bool, int],
                config: dict[str, Any] | None) -> tuple[int, int, int, int, int, bool, int]:
    """:func:`_config`'s choice with a benchmark's ``BLOCK_M`` / ``num_warps`` / ``SINGLE_PASS: False`` override."""
    block_m, p0, p1, p2, block_k, single, num_warps = chosen
    if config:
        block_m = int(config.get("BLOCK_M", block_m))
        num_warps = int(config.get("num_warps", num_warps))
        if config.get("SINGLE_PASS", single) is False and single:  # two passes over BLOCK_K chunks instead
            single, block_k = False, int(config.get("BLOCK_K", MULTI_PASS_BLOCK_K))
            p0, p1, p2 = block_k, 0, 0
    return block_m, p0, p1, p2, block_k, single, num_warps


def _out_buffers(q_out: torch.Tensor | None, scale_out: torch.Tensor | None, m: int, k: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    q = _checked_out(q_out, (m, k), FP8_DTYPE, device) if q_out is not None else torch.empty(
        (m, k), dtype=FP8_DTYPE, device=device)
    scale = _checked_out(scale_out, (m, 1), torch.float32, device) if scale_out is not None else torch.empty(
        (m, 1), dtype=torch.float32, device=device)
    return q, scale


def _checked_out(buf: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``buf`` when it can take ``shape`` rows (at least as many columns, unit column stride), else an error."""
    if (buf.dtype != dtype or buf.device != device or buf.dim() != 2 or buf.shape[0] != shape[0]
            or buf.shape[1] < shape[1] or buf.stride(1) != 1):
        raise QuantizationInputError(f"launch_rowwise_fp8: output buffer must be {dtype} [{shape[0]}, >= {shape[1]}] "
                                     f"with unit column stride on {device}")
    return buf


def triton_quantize_rowwise_fp8(
    x: torch.Tensor, *, clip_counter: torch.Tensor | None = None, software_rounding: bool | None = None,
    config: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize every row of ``x`` with the fused Triton kernel (same result as the torch reference).

    Args:
        x: float tensor ``[..., K]`` on a CUDA device (or on the CPU with ``TRITON_INTERPRET=1``). Rows may be
            strided (a slice of a wider tensor); a last-dimension stride other than 1 costs one copy.
        clip_counter: optional int32 tensor with one element on ``x``'s device; the number of clipped elements
            is added to it (no host synchronisation).
        software_rounding: round onto the e4m3 grid in float32 bit arithmetic before the cast. ``None``
            (default) does so only under the interpreter; on CUDA both settings give the same bytes.
        config: optional ``{"BLOCK_M", "num_warps"}`` override (benchmark sweeps; same bytes for any value).

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
    check_clip_counter(clip_counter, x)
    q, scale, _ = launch_rowwise_fp8(x, clip_counter=clip_counter, software_rounding=software_rounding,
                                     config=config)
    return q, scale


__all__ = [
    "ACTIVATION_GELU_ERF",
    "ACTIVATION_GELU_TANH",
    "ACTIVATION_NONE",
    "SINGLE_PASS_MAX_K",
    "TRITON_AVAILABLE",
    "check_clip_counter",
    "interpreter_enabled",
    "launch_config",
    "launch_rowwise_fp8",
    "reference_quantize_rowwise_fp8",
    "row_pieces",
    "triton_quantize_rowwise_fp8",
]
