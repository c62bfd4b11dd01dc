"""AdaLN pointwise chains of DiT blocks as single Triton kernels, each beside the torch reference it reproduces.

All three kernels work on a ``[B, S, C]`` residual stream: the first operand (``norm`` / ``x``) and the output are
contiguous, the second (``y``) may have any strides. They read the per-block modulation *directly* from the block's ``scale_shift_table`` (``[6, C]`` view) and the
timestep projection ``emb`` (``[B, T, 6, C]`` view, ``T`` = 1 or ``S``): the eager modulation-table add
(``table + emb``) and its split never run as kernels of their own. Row ``r`` of the stream belongs to sample
``r // S`` and token ``r % S``.

``precision`` says where eager rounds:

* ``"float32"`` (Wan): every operation in float32 (eager promotes through ``temb.float()`` / ``x.float()``), one
  rounding to the output dtype at the end -- ``(norm * (1 + scale) + shift).type_as(x)`` and
  ``(x.float() + y * gate).type_as(x)``;
* ``"per_op"`` (SANA-Video): all operands share one dtype and eager rounds to it after *every* operation
  (``bf16 + bf16 -> bf16``): the modulation add, ``1 + scale``, the product and the sum are each rounded (to
  bfloat16; for a float32 model every float32 operation rounds to float32 by itself).

Functions (kernel / reference with the same signature):

* :func:`modulate` / :func:`reference_modulate`: ``norm * (1 + m[k_scale]) + m[k_shift]``;
* :func:`gated_residual` / :func:`reference_gated_residual`: ``x + y * m[k_gate]``;
* :func:`residual_add` / :func:`reference_residual_add`: ``x + y``;

where ``m[k] = table[k] + emb[:, :, k]``. Each can also write the float32 value of its (rounded) output
(``with_float=True``), which is exactly what the next eager ``hidden_states.float()`` would compute, so that cast
need not run as a kernel either.

Example (CPU, interpreter)::

    out = gated_residual(x, y, table, emb, 2, precision="float32")
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.core.fusion.indexing import INT32_MAX, needs_int64
from worldfoundry.core.fusion.launch import KernelLauncher
from worldfoundry.core.fusion.triton_support import (
    TRITON_AVAILABLE,
    launch_options,
    round_bf16,
    software_rounding,
    store_rounded,
    tl,
    triton,
)

PRECISIONS: Final = ("float32", "per_op")
MODE_MODULATE: Final = 0
MODE_GATE: Final = 1
MODE_ADD: Final = 2
#: Elements per program (rows x channels).
ELEMENTS_PER_PROGRAM: Final = 4096

if TRITON_AVAILABLE:

    @triton.jit
    def _mod_term(tbl_ptr, emb_ptr, b, s, c, mask, K, t_k, t_c, e_b, e_s, e_k, e_c,
                  PER_OP: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
        t = tl.load(tbl_ptr + K * t_k + c * t_c, mask=mask, other=0.0).to(tl.float32)
        e = tl.load(emb_ptr + b * e_b + s * e_s + K * e_k + c * e_c, mask=mask, other=0.0).to(tl.float32)
        m = t + e
        if PER_OP:
            m = round_bf16(m, SOFTWARE_ROUNDING)
        return m

    # the table rows are runtime values (one compiled variant serves every row: fewer compilations on first use)
    @triton.jit(do_not_specialize=["K0", "K1"])
    def _adaln_kernel(out_ptr, out32_ptr, a_ptr, b_ptr, tbl_ptr, emb_ptr, R, S, C,
                      y_b, y_s, y_c, t_k, t_c, e_b, e_s, e_k, e_c, K0, K1,
                      MODE: tl.constexpr, PER_OP: tl.constexpr, ROW_UNIFORM: tl.constexpr,
                      OUT_BF16: tl.constexpr, WRITE_F32: tl.constexpr, INDEX_64: tl.constexpr,
                      SOFTWARE_ROUNDING: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        if INDEX_64:  # widen before any multiply by a size or stride
            rows = rows.to(tl.int64)
            cols = cols.to(tl.int64)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        offs = rows[:, None] * C + cols[None, :]
        a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        bs = rows // S
        ss = rows - bs * S
        bb = bs[:, None]
        sb = ss[:, None]
        cb = cols[None, :]
        if ROW_UNIFORM:  # every row of the program is one sample's and the modulation is per sample: load it once
            first = tl.program_id(0) * BLOCK_R
            if INDEX_64:
                first = first.to(tl.int64)
            bb = first // S
            sb = 0
            cb = cols[None, :]
            mod_mask = (cols < C)[None, :]
        else:
            mod_mask = mask
        if MODE == 2:
            v = a + tl.load(b_ptr + bs[:, None] * y_b + ss[:, None] * y_s + cols[None, :] * y_c, mask=mask,
                            other=0.0).to(tl.float32)
        else:
            m0 = _mod_term(tbl_ptr, emb_ptr, bb, sb, cb, mod_mask, K0, t_k, t_c, e_b, e_s, e_k, e_c, PER_OP,
                           SOFTWARE_ROUNDING)
            if MODE == 0:
                m1 = _mod_term(tbl_ptr, emb_ptr, bb, sb, cb, mod_mask, K1, t_k, t_c, e_b, e_s, e_k, e_c, PER_OP,
                               SOFTWARE_ROUNDING)
                f = 1.0 + m1
                if PER_OP:
                    f = round_bf16(f, SOFTWARE_ROUNDING)
                p = a * f
                if PER_OP:
                    p = round_bf16(p, SOFTWARE_ROUNDING)
                v = p + m0
            else:
                y = tl.load(b_ptr + bs[:, None] * y_b + ss[:, None] * y_s + cols[None, :] * y_c, mask=mask,
                            other=0.0).to(tl.float32)
                p = y * m0
                if PER_OP:
                    p = round_bf16(p, SOFTWARE_ROUNDING)
                v = a + p
        if WRITE_F32:
            if OUT_BF16:
                v = round_bf16(v, SOFTWARE_ROUNDING)
            tl.store(out32_ptr + offs, v, mask=mask)
        store_rounded(out_ptr + offs, v, mask, OUT_BF16, SOFTWARE_ROUNDING)


def _blocks(c: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): the channel block wasting the fewest lanes, rows filling :data:`ELEMENTS_PER_PROGRAM`."""
    best = min((512, 256, 128), key=lambda b: (-(-c // b) * b - c, -b))
    if c <= 64:
        best = max(16, 1 << (c - 1).bit_length())
    return max(1, ELEMENTS_PER_PROGRAM // best), best


def _emb4(emb: torch.Tensor) -> torch.Tensor:
    """``emb`` as ``[B, T, 6, C]`` (a ``[B, 6, C]`` emb gets ``T = 1``)."""
    return emb.unsqueeze(1) if emb.dim() == 3 else emb


#: Launch plans by operand geometry (shapes, strides, dtypes, flags): grid, integer arguments and constexprs are
#: computed once per geometry, so a call only allocates its outputs and launches
#: (:class:`~worldfoundry.core.fusion.launch.KernelLauncher`, which also keeps the compiled kernels).
_PLANS: dict[tuple, KernelLauncher] = {}
_MAX_PLANS: Final = 512


def _plan(key: tuple, mode: int, out_dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor | None,
          table: torch.Tensor | None, emb: torch.Tensor | None, precision: str, with_float: bool,
          index_limit: int) -> KernelLauncher:
    """The launcher of one geometry: grid, integer arguments and constexprs fixed (see :data:`_PLANS`)."""
    bsz, s, c = a.shape
    if table is not None:
        e4 = _emb4(emb)
        t_k, t_c = table.stride()
        e_b, e_s, e_k, e_c = e4.stride()
        if e4.shape[1] == 1:
            e_s = 0
        wide = needs_int64(a, b, table, e4, extra=a.numel(), limit=index_limit)
    else:
        t_k = t_c = e_b = e_s = e_k = e_c = 0
        wide = needs_int64(a, b, extra=a.numel(), limit=index_limit)
    y_b, y_s, y_c = b.stride() if b is not None else (0, 0, 0)
    block_r, block_c = _blocks(c)
    rows = bsz * s
    grid = (-(-rows // block_r), -(-c // block_c))  # plain ints: triton.cdiv is a slow constexpr function
    ints = (rows, s, c, y_b, y_s, y_c, t_k, t_c, e_b, e_s, e_k, e_c)
    kwargs = dict(MODE=mode, ROW_UNIFORM=e_s == 0 and s % block_r == 0,
                  PER_OP=precision == "per_op" and out_dtype == torch.bfloat16, OUT_BF16=out_dtype == torch.bfloat16,
                  WRITE_F32=with_float, INDEX_64=wide, SOFTWARE_ROUNDING=software_rounding(), BLOCK_R=block_r,
                  BLOCK_C=block_c, **launch_options())
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = KernelLauncher(_adaln_kernel, grid, n_pointers=6, fixed=ints, constexprs=kwargs)
    _PLANS[key] = plan
    return plan


def _launch(mode: int, out_dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor | None, table: torch.Tensor | None,
            emb: torch.Tensor | None, k0: int, k1: int, precision: str, with_float: bool,
            index_limit: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    # ``a`` is contiguous (every caller checks) and the output is allocated like it, so its shape is its geometry;
    # the interpreter flag is read when a plan is made (a process does not switch it for CUDA tensors)
    if table is None:
        key = (mode, out_dtype, a.dtype, a.shape, b.dtype, b.stride(), with_float, index_limit)
    else:
        key = (mode, out_dtype, a.dtype, a.shape, None if b is None else (b.dtype, b.stride()), table.dtype,
               table.stride(), emb.dtype, emb.shape, emb.stride(), precision, with_float, index_limit)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(key, mode, out_dtype, a, b, table, emb, precision, with_float, index_limit)
    out = torch.empty(a.shape, dtype=out_dtype, device=a.device)
    if with_float:
        out32 = torch.empty(a.shape, dtype=torch.float32, device=a.device)
        plan((out, out32, a, a if b is None else b, a if table is None else table, a if emb is None else emb),
             (k0, k1))
        return out, out32
    plan((out, out, a, a if b is None else b, a if table is None else table, a if emb is None else emb), (k0, k1))
    return out, None


def modulate(norm: torch.Tensor, table: torch.Tensor, emb: torch.Tensor, k_shift: int, k_scale: int, *,
             out_dtype: torch.dtype, precision: str = "float32", with_float: bool = False,
             index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm * (1 + m[k_scale]) + m[k_shift])`` as ``out_dtype``, ``m[k] = table[k] + emb[:, :, k]``.

    Args:
        norm: ``[B, S, C]`` contiguous normalised stream (the LayerNorm output).
        table: ``[6, C]`` modulation table (any strides).
        emb: ``[B, 6, C]`` or ``[B, T, 6, C]`` timestep projection (``T`` = 1 or ``S``; any strides).
        k_shift, k_scale: the table rows of shift and scale.
        out_dtype: bfloat16 or float32 (the eager ``.type_as`` / ``.to`` target).
        precision: ``"float32"`` or ``"per_op"`` (see the module docstring).
        with_float: also return the float32 value of the rounded output.
        index_limit: offsets above this use 64-bit arithmetic (tests lower it).

    Returns:
        ``(out, out_float or None)``.
    """
    return _launch(MODE_MODULATE, out_dtype, norm, None, table, emb, k_shift, k_scale, precision, with_float,
                   index_limit)


def gated_residual(x: torch.Tensor, y: torch.Tensor, table: torch.Tensor, emb: torch.Tensor, k_gate: int, *,
                   out_dtype: torch.dtype | None = None, precision: str = "float32", with_float: bool = False,
                   x_float: torch.Tensor | None = None,
                   index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x + y * m[k_gate]`` as ``out_dtype`` (default ``x.dtype``); arguments as :func:`modulate`.

    ``x_float`` (the float32 value of ``x``, bitwise ``x.float()``) may be read instead of ``x``.
    """
    a = x if x_float is None else x_float
    return _launch(MODE_GATE, out_dtype or x.dtype, a, y, table, emb, k_gate, 0, precision, with_float,
                   index_limit)


def residual_add(x: torch.Tensor, y: torch.Tensor, *, out_dtype: torch.dtype | None = None,
                 with_float: bool = False, index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x + y`` (rounded once to ``out_dtype``, default ``x.dtype``); optionally its float32 value."""
    return _launch(MODE_ADD, out_dtype or x.dtype, x, y, None, None, 0, 0, "float32", with_float, index_limit)


# ---------------------------------------------------------------------------------------------- references
def _reference_mod(table: torch.Tensor, emb: torch.Tensor, k: int, precision: str) -> torch.Tensor:
    e4 = _emb4(emb)[:, :, k]
    if precision == "float32":
        return table[k] + e4.float()
    return table[k] + e4


def _finish(v: torch.Tensor, out_dtype: torch.dtype, with_float: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = v.to(out_dtype)
    return out, (out.float() if with_float else None)


def reference_modulate(norm: torch.Tensor, table: torch.Tensor, emb: torch.Tensor, k_shift: int, k_scale: int, *,
                       out_dtype: torch.dtype, precision: str = "float32", with_float: bool = False,
                       index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of :func:`modulate` (eager's operations in eager's order)."""
    shift = _reference_mod(table, emb, k_shift, precision)
    scale = _reference_mod(table, emb, k_scale, precision)
    return _finish(norm * (1 + scale) + shift, out_dtype, with_float)


def reference_gated_residual(x: torch.Tensor, y: torch.Tensor, table: torch.Tensor, emb: torch.Tensor, k_gate: int,
                             *, out_dtype: torch.dtype | None = None, precision: str = "float32",
                             with_float: bool = False, x_float: torch.Tensor | None = None,
                             index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of :func:`gated_residual`."""
    gate = _reference_mod(table, emb, k_gate, precision)
    if precision == "float32":
        v = x.float() + y.float() * gate
    else:
        v = x + gate * y
    return _finish(v, out_dtype or x.dtype, with_float)


def reference_residual_add(x: torch.Tensor, y: torch.Tensor, *, out_dtype: torch.dtype | None = None,
                           with_float: bool = False,
                           index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of :func:`residual_add`."""
    return _finish(x + y, out_dtype or x.dtype, with_float)


__all__ = [
    "PRECISIONS",
    "gated_residual",
    "modulate",
    "reference_gated_residual",
    "reference_modulate",
    "reference_residual_add",
    "residual_add",
]
