"""The gated SiLU of SANA-Video's ``GLUMBTempConv`` feed-forward, ``h * silu(g)``, as one Triton kernel.

Eager diffusers runs ``hidden_states, gate = torch.chunk(x, 2, dim=1)`` and ``hidden_states * silu(gate)``: two
kernels over the two (non-contiguous) halves and three passes over tensors of ``B * F * H * W * C`` elements. The
kernel reads both halves once and writes the product once, with the operations of PyTorch's CUDA kernels:

* SiLU (``SiluFunctor``, ``ActivationSiluKernel.cu``): in float32 (the op-math type of bfloat16/float16/float32)
  ``x / (1 + exp(-x))`` with the full-precision ``expf`` and an IEEE division, rounded to the tensor's dtype;
* the product (``mul`` over ``TensorIterator``): ``float(h) * float(silu)``, rounded to the tensor's dtype.

On CUDA the kernel uses libdevice's ``__nv_expf`` (not Triton's fast ``exp``) and ``tl.div_rn``, with contraction
off, so its output is bitwise eager's. Triton's interpreter has no libdevice: there ``exp`` is numpy's float32
``exp``, which differs from torch's CPU ``exp`` in the last bit of many values -- the interpreted kernel is
bitwise :func:`reference_silu_gate_formula` with numpy's ``exp`` (what the CPU tests check), not torch's CPU SiLU.

The output has the strides eager's ``h * silu(g)`` output has (TensorIterator's choice, reproduced by
:mod:`~worldfoundry.core.fusion.layout` once per geometry; channels-last halves give a channels-last product),
so the convolutions after it see the same layout. The kernel works on a ``[rows, columns]`` view of that layout:
columns are the output's innermost dimension, rows the others, merged where every operand's strides allow (at
most three row dimensions; channels-last halves of a ``[N, 2C, H, W]`` tensor give one).

Example (CPU, interpreter)::

    x = torch.randn(2, 8, 3, 5).to(memory_format=torch.channels_last)
    h, g = x.chunk(2, dim=1)
    out = silu_gate(h, g)        # == h * F.silu(g) on CUDA, bitwise; strides of eager's output
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import torch
import torch.nn.functional as F

from worldfoundry.core.fusion.indexing import INT32_MAX, needs_int64
from worldfoundry.core.fusion.launch import KernelLauncher
from worldfoundry.core.fusion.layout import elementwise_strides
from worldfoundry.core.fusion.triton_support import (
    TRITON_AVAILABLE,
    interpreter_enabled,
    launch_options,
    round_bf16,
    software_rounding,
    tl,
    triton,
)

#: Dtypes of the two halves the kernel takes (both the same).
GLU_DTYPES: Final = (torch.bfloat16, torch.float16, torch.float32)
_KIND: Final = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: Elements per program (rows x columns).
ELEMENTS_PER_PROGRAM: Final = 4096
#: Row dimensions the kernel decomposes (more, after merging, is refused).
MAX_ROW_DIMS: Final = 3

try:  # CUDA's libdevice (``__nv_expf``: the expf PyTorch's CUDA SiLU calls)
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover - triton absent or without the CUDA backend
    libdevice = None

if TRITON_AVAILABLE:

    @triton.jit
    def _round(v, KIND: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
        """Float32 ``v`` rounded to the operands' dtype (``KIND``: 0 float32, 1 bfloat16, 2 float16), as float32."""
        if KIND == 1:
            v = round_bf16(v, SOFTWARE_ROUNDING)
        elif KIND == 2:
            v = v.to(tl.float16).to(tl.float32)
        return v

    @triton.jit
    def _offsets(rows, cols, D1, D2, s0, s1, s2, sc, ROW_DIMS: tl.constexpr):
        """Offsets of ``[rows, cols]`` in one operand with row dimensions ``(D0, D1, D2)`` (the last ROW_DIMS)."""
        if ROW_DIMS == 1:
            r = rows * s2
        elif ROW_DIMS == 2:
            i1 = rows // D2
            r = i1 * s1 + (rows - i1 * D2) * s2
        else:
            t = rows // D2
            i0 = t // D1
            r = i0 * s0 + (t - i0 * D1) * s1 + (rows - t * D2) * s2
        return r[:, None] + cols[None, :] * sc

    @triton.jit
    def _silu_gate_kernel(out_ptr, h_ptr, g_ptr, R, C, N_CB, D1, D2, h0, h1, h2, hc, g0, g1, g2, gc,
                          ROW_DIMS: tl.constexpr, KIND: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                          INDEX_64: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
        pid = tl.program_id(0)
        pr = pid // N_CB
        pc = pid - pr * N_CB
        rows = pr * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
        if INDEX_64:  # widen before any multiply by a size or stride
            rows = rows.to(tl.int64)
            cols = cols.to(tl.int64)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        g = tl.load(g_ptr + _offsets(rows, cols, D1, D2, g0, g1, g2, gc, ROW_DIMS), mask=mask,
                    other=0.0).to(tl.float32)
        h = tl.load(h_ptr + _offsets(rows, cols, D1, D2, h0, h1, h2, hc, ROW_DIMS), mask=mask,
                    other=0.0).to(tl.float32)
        if LIBDEVICE_EXP:
            e = libdevice.exp(-g)
        else:  # the interpreter (numpy's float32 exp)
            e = tl.exp(-g)
        s = _round(tl.div_rn(g, 1.0 + e), KIND, SOFTWARE_ROUNDING)
        v = _round(h * s, KIND, SOFTWARE_ROUNDING)
        offs = rows[:, None] * C + cols[None, :]
        if KIND == 1:
            tl.store(out_ptr + offs, v.to(tl.bfloat16), mask=mask)
        elif KIND == 2:
            tl.store(out_ptr + offs, v.to(tl.float16), mask=mask)
        else:
            tl.store(out_ptr + offs, v, mask=mask)


def silu_gate_reason(h: torch.Tensor, g: torch.Tensor) -> str | None:
    """Why ``h`` and ``g`` cannot take :func:`silu_gate` (``None`` when they can; the device is not checked).

    Args:
        h, g: the two halves.

    Returns:
        A one-line reason, or ``None``.
    """
    if h.dtype not in GLU_DTYPES:
        return f"dtype {h.dtype} is not bfloat16/float16/float32"
    if g.dtype != h.dtype:
        return "the halves differ in dtype"
    if g.shape != h.shape or g.device != h.device:
        return "the halves differ in shape or device"
    return None


def eager_strides(h: torch.Tensor, g: torch.Tensor) -> tuple[int, ...]:
    """The strides of eager's ``h * silu(g)`` output: TensorIterator's choice for ``silu(g)``, then for the product
    of ``h`` and that (:func:`~worldfoundry.core.fusion.layout.elementwise_strides`)."""
    silu = elementwise_strides(g.shape, [g.stride()])
    return elementwise_strides(h.shape, [h.stride(), silu])


def collapse(shape: tuple[int, ...], out: tuple[int, ...], *others: tuple[int, ...]
             ) -> list[tuple[int, int, tuple[int, ...]]]:
    """The dimensions of a dense output and its operands, outermost first, size-1 dimensions dropped and
    neighbours merged where every operand's strides nest.

    Args:
        shape: the common shape.
        out: the output's strides (dense in some order).
        *others: each operand's strides.

    Returns:
        ``[(size, out_stride, operand_strides), ...]``; one ``(1, 1, (0, ...))`` entry for a one-element shape.
    """
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -out[d])
    merged: list[tuple[int, int, tuple[int, ...]]] = []
    for d in dims:
        entry = (shape[d], out[d], tuple(s[d] for s in others))
        if merged:
            size, o, strides = merged[-1]
            if o == entry[1] * entry[0] and all(a == b * entry[0] for a, b in zip(strides, entry[2], strict=True)):
                merged[-1] = (size * entry[0], entry[1], entry[2])
                continue
        merged.append(entry)
    return merged or [(1, 1, tuple(0 for _ in others))]


def _blocks(r: int, c: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): the column block wasting the fewest lanes; few rows widen it."""
    if c <= 64:
        bc = max(16, 1 << (c - 1).bit_length())
    else:
        bc = min((512, 256, 128), key=lambda b: (-(-c // b) * b - c, -b))
    br = max(1, min(ELEMENTS_PER_PROGRAM // bc, 1 << max(0, r - 1).bit_length()))
    if br * bc < ELEMENTS_PER_PROGRAM and c > bc:
        bc = min(ELEMENTS_PER_PROGRAM // br, 1 << (c - 1).bit_length())
    return br, bc


#: Launch plans (and the eager output strides) by operand geometry.
_PLANS: dict[tuple, tuple[KernelLauncher, tuple[int, ...]]] = {}
_MAX_PLANS: Final = 512


def _plan(h: torch.Tensor, g: torch.Tensor, index_limit: int) -> tuple[KernelLauncher, tuple[int, ...]]:
    out_strides = eager_strides(h, g)
    dims = collapse(tuple(h.shape), out_strides, h.stride(), g.stride())
    c, oc, (hc, gc) = dims[-1]
    if oc != 1:
        raise ValueError(f"eager's output strides {out_strides} are not dense; use the reference")
    rows = dims[:-1]
    if len(rows) > MAX_ROW_DIMS:
        raise ValueError(f"the halves need {len(rows)} row dimensions (at most {MAX_ROW_DIMS}); use the reference")
    padded = [(1, 0, (0, 0))] * (MAX_ROW_DIMS - len(rows)) + rows
    r = 1
    for size, _, _ in rows:
        r *= size
    (_, _, (h0, g0)), (d1, _, (h1, g1)), (d2, _, (h2, g2)) = padded
    block_r, block_c = _blocks(r, c)
    n_cb = -(-c // block_c)
    grid = (-(-r // block_r) * n_cb,)  # plain ints: triton.cdiv is a slow constexpr function
    wide = needs_int64(h, g, extra=h.numel() + block_r * c + ELEMENTS_PER_PROGRAM, limit=index_limit)
    kwargs = dict(ROW_DIMS=max(1, len(rows)), KIND=_KIND[h.dtype], LIBDEVICE_EXP=not interpreter_enabled(),
                  INDEX_64=wide, SOFTWARE_ROUNDING=software_rounding(), BLOCK_R=block_r, BLOCK_C=block_c,
                  **launch_options())
    ints = (r, c, n_cb, d1, d2, h0, h1, h2, hc, g0, g1, g2, gc)
    return KernelLauncher(_silu_gate_kernel, grid, n_pointers=3, fixed=ints, constexprs=kwargs), out_strides


def silu_gate(h: torch.Tensor, g: torch.Tensor, *, index_limit: int = INT32_MAX) -> torch.Tensor:
    """``h * silu(g)`` in one launch, bitwise eager's on CUDA, with the strides eager's output has.

    Args:
        h, g: the two halves (any strides; typically ``torch.chunk(x, 2, dim=1)`` of one tensor), one dtype of
            :data:`GLU_DTYPES`, one shape, one device (CUDA, or the CPU under Triton's interpreter).
        index_limit: offsets above this use 64-bit arithmetic (tests lower it).

    Returns:
        The product, a new tensor.

    Raises:
        ValueError: the halves do not fit (:func:`silu_gate_reason`, more than three row dimensions after
            merging); the caller runs :func:`reference_silu_gate` instead.
    """
    key = (h.dtype, h.shape, h.stride(), g.dtype, g.stride(), h.device.type, index_limit)
    entry = _PLANS.get(key)
    if entry is None:
        reason = silu_gate_reason(h, g)
        if reason is not None:
            raise ValueError(f"silu_gate: {reason}; use the reference")
        entry = _plan(h, g, index_limit)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = entry
    plan, strides = entry
    out = torch.empty_strided(h.shape, strides, dtype=h.dtype, device=h.device)
    if out.numel():
        plan((out, h, g))
    return out


def reference_silu_gate(h: torch.Tensor, g: torch.Tensor, *, index_limit: int = INT32_MAX) -> torch.Tensor:
    """Torch reference of :func:`silu_gate`: eager's ``h * silu(g)`` itself."""
    return h * F.silu(g)


def reference_silu_gate_formula(h: torch.Tensor, g: torch.Tensor,
                                exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp) -> torch.Tensor:
    """``h * silu(g)`` written out as PyTorch's CUDA kernels compute it, with a chosen float32 ``exp``.

    ``g`` in float32, ``g / (1 + exp(-g))`` rounded to the dtype, then ``float(h) * float(silu)`` rounded to it;
    laid out as eager's output. With ``torch.exp`` on CUDA (or on the CPU for bfloat16/float16) this is bitwise
    :func:`reference_silu_gate`; with numpy's ``exp`` it is bitwise the interpreted kernel.
    """
    gf = g.float()
    s = (gf / (1 + exp(-gf))).to(g.dtype)
    out = torch.empty_strided(h.shape, eager_strides(h, g), dtype=h.dtype, device=h.device)
    return out.copy_((h.float() * s.float()).to(h.dtype))


__all__ = [
    "GLU_DTYPES",
    "collapse",
    "eager_strides",
    "reference_silu_gate",
    "reference_silu_gate_formula",
    "silu_gate",
    "silu_gate_reason",
]
