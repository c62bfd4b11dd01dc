"""PyTorch's CUDA LayerNorm, reproduced bitwise in Triton, with the AdaLN epilogue fused in.

Wan's blocks normalise the float32 stream with ``FP32LayerNorm`` and then modulate it: ``norm1(x.float()) * (1 +
scale) + shift``, cast to the stream's dtype. Eager runs this as PyTorch's LayerNorm kernel (float32 output) and one
more kernel; :func:`layer_norm_modulate` does it in one kernel that reads the stream once and writes the modulated
result, bitwise equal to eager. :func:`layer_norm` is the same kernel with LayerNorm's own affine epilogue (Wan's
``norm2`` followed by ``.type_as(x)``), or no epilogue.

**What is reproduced.** PyTorch (2.11 and later, CUDA) normalises a row of ``N`` elements with
``vectorized_layer_norm_kernel`` when ``N`` is a multiple of 4, at most 2^24, and every operand is 16-byte aligned
(:func:`torch_path_reason` checks this; otherwise PyTorch runs another algorithm and the callers fall back). That
kernel gives each row a block of 128 threads (4 warps of 32); thread ``t`` reads the 4-element vectors ``t, t + 128,
...`` and folds each element into a Welford state ``(mean, m2, count)`` in order; the warps then combine their lanes
by shuffling down (offsets 16, 8, 4, 2, 1: lane ``l`` merges lane ``l + offset`` into its own state) and the four
warp results are merged the same way (warps 2, 3 into 0, 1, then 1 into 0). The variance is ``m2 / N`` (IEEE
division), ``rstd = rsqrt(var + eps)`` and the output ``rstd * (x - mean)``; with weight and bias
``weight * that + bias``. The reciprocals ``1 / count`` are IEEE divisions; where the compiled CUDA code contracts a
multiply and an add into one fused multiply-add, the kernel calls ``tl.fma`` explicitly, and every other operation
rounds on its own (the kernel is compiled without contraction). The kernel here holds the 128 per-thread states as
one 128-lane vector per row and performs the same merges in the same order, so mean, ``rstd`` and every output
element carry the same bits.

On the CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``); there ``rsqrt`` is ``1 / sqrt``
(computed in float64 by the interpreter), and :func:`reference_layer_norm` (torch, the same algorithm step by step) takes ``approx_rsqrt=False`` to
match it. On the GPU the kernel is checked against ``torch.nn.functional.layer_norm`` itself.

Example (CPU, interpreter)::

    out = layer_norm_modulate(x, 1e-6, table, temb, 0, 1, out_dtype=torch.bfloat16)
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.core.fusion.adaln import _emb4
from worldfoundry.core.fusion.indexing import INT32_MAX, needs_int64
from worldfoundry.core.fusion.launch import KernelLauncher
from worldfoundry.core.fusion.triton_support import (
    TRITON_AVAILABLE,
    launch_options,
    software_rounding,
    store_rounded,
    tl,
    triton,
)

#: Threads per row of PyTorch's vectorized LayerNorm kernel (``num_threads()`` on CUDA: 4 warps of 32).
THREADS: Final = 128
WARP: Final = 32
VEC: Final = 4
#: The largest row PyTorch normalises with the vectorized kernel (``N <= 2^24``).
MAX_N: Final = 1 << 24
MODE_PLAIN: Final = 0
MODE_MODULATE: Final = 1
MODE_RMS: Final = 2
#: Which product of ``nA * mean_A + nB * mean_B`` the CUDA build contracts (0: the first; 1: the second; 2: none).
#: 0 matched ``torch.native_layer_norm`` bitwise on the H200 (torch 2.11) in every row checked
#: (``benchmarks/kernels/layer_norm_exact.py``: 85 cases, 114,192 rows); 1 and 2 did not.
MEAN_FMA: Final = 0
#: Rows per program (the modulation rows are loaded once per program when they are per sample), channels per chunk
#: of the output pass, warps per program.
ROWS_PER_PROGRAM: Final = 8
BLOCK_C: Final = 512
NUM_WARPS: Final = 8

if TRITON_AVAILABLE:
    from worldfoundry.core.fusion.adaln import _mod_term

    @triton.jit
    def _combine(b_mean, b_m2, b_n, a_mean, a_m2, a_n, MEAN_ORDER: tl.constexpr, RMS: tl.constexpr):
        """PyTorch's ``cuWelfordCombine(dataB, dataA)``: ``B`` is the running state, ``A`` the one merged in
        (RMSNorm: the sums of squares add, mean and count stay 0)."""
        if RMS:
            return b_mean, b_m2 + a_m2, b_n
        delta = b_mean - a_mean
        count = a_n + b_n
        safe = tl.where(count > 0.0, count, 1.0)
        coef = tl.math.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe)
        n_a = a_n * coef
        n_b = b_n * coef
        if MEAN_ORDER == 0:
            mean = tl.fma(n_a, a_mean, n_b * b_mean)
        elif MEAN_ORDER == 1:
            mean = tl.fma(n_b, b_mean, n_a * a_mean)
        else:
            mean = n_a * a_mean + n_b * b_mean
        m2 = tl.fma(delta * delta * a_n, n_b, a_m2 + b_m2)
        zero = tl.zeros(mean.shape, tl.float32)
        return tl.where(count > 0.0, mean, zero), tl.where(count > 0.0, m2, zero), count

    @triton.jit
    def _halve(mean, m2, n, HALF: tl.constexpr, ROWS: tl.constexpr, MEAN_ORDER: tl.constexpr, RMS: tl.constexpr):
        """One shuffle-down step on ``[ROWS, 2 * HALF]`` lane states: lane ``l < HALF`` merges lane ``l + HALF``
        (RMSNorm: only the sums of squares; mean and count stay zero and are not shuffled)."""
        own_v, oth_v = tl.split(tl.permute(tl.reshape(m2, (ROWS, 2, HALF)), (0, 2, 1)))
        if RMS:
            zero = tl.zeros((ROWS, HALF), tl.float32)
            return zero, own_v + oth_v, zero
        own_m, oth_m = tl.split(tl.permute(tl.reshape(mean, (ROWS, 2, HALF)), (0, 2, 1)))
        own_n, oth_n = tl.split(tl.permute(tl.reshape(n, (ROWS, 2, HALF)), (0, 2, 1)))
        return _combine(own_m, own_v, own_n, oth_m, oth_v, oth_n, MEAN_ORDER, RMS)

    @triton.jit
    def _row_stats(x_ptr, rows, live_rows, N, row_stride, eps, R: tl.constexpr, NV: tl.constexpr,
                   MEAN_ORDER: tl.constexpr, APPROX_RSQRT: tl.constexpr, RMS: tl.constexpr):
        """(mean, rstd), each ``[R, 1]``, of ``R`` rows in the order of PyTorch's ``compute_stats`` (module docs).

        Row ``r`` starts at ``x_ptr + r * row_stride`` (``N`` for a contiguous tensor) and its ``N`` elements are
        contiguous. Each row's 128 thread states are one 128-lane vector; masked-out rows compute on zeros and are
        not stored.
        """
        t = tl.arange(0, 128)
        mean = tl.zeros((R, 128), tl.float32)
        m2 = tl.zeros((R, 128), tl.float32)
        n = tl.zeros((R, 128), tl.float32)
        n_vec = N // 4
        base = rows[:, None] * row_stride
        for i in tl.range(0, NV, loop_unroll_factor=1):  # a loop, not unrolled: the same order, less to compile
            v_idx = i * 128 + t
            live = live_rows[:, None] & (v_idx < n_vec)[None, :]
            for ii in tl.static_range(4):
                val = tl.load(x_ptr + base + (v_idx * 4 + ii)[None, :], mask=live, other=0.0).to(tl.float32)
                if RMS:  # PyTorch's RMSNorm: sigma2 + val * val (contracted), no mean, no count
                    m2 = tl.where(live, tl.fma(val, val, m2), m2)
                else:
                    delta = val - mean
                    new_n = n + 1.0
                    # every live lane holds the same count at this step (i * 4 + ii + 1): one IEEE reciprocal
                    recip = tl.math.div_rn(tl.full((1, 1), 1.0, tl.float32),
                                           tl.zeros((1, 1), tl.float32) + (i * 4 + ii + 1))
                    new_mean = tl.fma(delta, recip, mean)
                    new_m2 = tl.fma(delta, val - new_mean, m2)
                    mean = tl.where(live, new_mean, mean)
                    m2 = tl.where(live, new_m2, m2)
                    n = tl.where(live, new_n, n)
        # 4 warps x 32 lanes per row: shuffle-down within each warp, then warps 2, 3 into 0, 1 and 1 into 0
        mean, m2, n = _halve(mean, m2, n, 16, R * 4, MEAN_ORDER, RMS)
        mean, m2, n = _halve(mean, m2, n, 8, R * 4, MEAN_ORDER, RMS)
        mean, m2, n = _halve(mean, m2, n, 4, R * 4, MEAN_ORDER, RMS)
        mean, m2, n = _halve(mean, m2, n, 2, R * 4, MEAN_ORDER, RMS)
        mean, m2, n = _halve(mean, m2, n, 1, R * 4, MEAN_ORDER, RMS)
        mean, m2, n = _halve(mean, m2, n, 2, R, MEAN_ORDER, RMS)
        mean, m2, n = _halve(mean, m2, n, 1, R, MEAN_ORDER, RMS)
        # the statistics stay float32 tensors ([R, 1]): the interpreter computes scalars in float64
        var = tl.math.div_rn(m2, tl.full((R, 1), N, tl.float32))
        v = var + eps
        if APPROX_RSQRT:
            rstd = tl.math.rsqrt(v)
        else:
            # the interpreter (CPU): in float64, rounded once (its float32 scalar arithmetic is not reproducible)
            rstd = (tl.full((R, 1), 1.0, tl.float64) / tl.sqrt(v.to(tl.float64))).to(tl.float32)
        return mean, rstd

    @triton.jit(do_not_specialize=["K0", "K1"])
    def _ln_kernel(out_ptr, stats_ptr, x_ptr, w_ptr, b_ptr, tbl_ptr, emb_ptr, M, S, N, eps, t_k, t_c, e_b, e_s, e_k,
                   e_c, K0, K1, MODE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                   OUT_BF16: tl.constexpr, WRITE_STATS: tl.constexpr, NV: tl.constexpr, R: tl.constexpr,
                   BLOCK_C: tl.constexpr, N_CHUNKS: tl.constexpr, ROW_UNIFORM: tl.constexpr,
                   MEAN_ORDER: tl.constexpr, APPROX_RSQRT: tl.constexpr, INDEX_64: tl.constexpr,
                   SOFTWARE_ROUNDING: tl.constexpr):
        first = tl.program_id(0) * R
        rows = first + tl.arange(0, R)
        if INDEX_64:  # widen before any multiply by a size or stride
            first = first.to(tl.int64)
            rows = rows.to(tl.int64)
        live_rows = rows < M
        mean, rstd = _row_stats(x_ptr, rows, live_rows, N, N, eps, R, NV, MEAN_ORDER, APPROX_RSQRT, MODE == 2)
        bs = rows // S
        ss = rows - bs * S
        for chunk in tl.range(0, N_CHUNKS, loop_unroll_factor=1):  # chunks are independent: a loop, not unrolled
            cols = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
            mask = live_rows[:, None] & (cols < N)[None, :]
            offs = rows[:, None] * N + cols[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if MODE == 2:
                y = rstd * x
            else:
                y = rstd * (x - mean)
            if MODE == 1:
                if ROW_UNIFORM:  # one sample per program and a per-sample modulation: one row of it
                    bb = first // S
                    sb = 0
                    cb = cols[None, :]
                    mod_mask = (cols < N)[None, :]
                else:
                    bb = bs[:, None]
                    sb = ss[:, None]
                    cb = cols[None, :]
                    mod_mask = mask
                shift = _mod_term(tbl_ptr, emb_ptr, bb, sb, cb, mod_mask, K0, t_k, t_c, e_b, e_s, e_k, e_c, False,
                                  SOFTWARE_ROUNDING)
                scale = _mod_term(tbl_ptr, emb_ptr, bb, sb, cb, mod_mask, K1, t_k, t_c, e_b, e_s, e_k, e_c, False,
                                  SOFTWARE_ROUNDING)
                y = y * (1.0 + scale) + shift
            else:
                if HAS_W:
                    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
                    if HAS_B:
                        bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
                        y = tl.fma(w, y, bias)
                    else:
                        y = w * y
                elif HAS_B:
                    y = y + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            store_rounded(out_ptr + offs, y, mask, OUT_BF16, SOFTWARE_ROUNDING)
        if WRITE_STATS:
            one = tl.arange(0, 1)[None, :]
            tl.store(stats_ptr + rows[:, None] * 2 + one, mean, mask=live_rows[:, None])
            tl.store(stats_ptr + rows[:, None] * 2 + 1 + one, rstd, mask=live_rows[:, None])


def torch_path_reason(x: torch.Tensor, weight: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None) -> str | None:
    """Why PyTorch would not normalise ``x`` (last dim) with its vectorized kernel, or ``None`` when it would.

    Only that kernel's algorithm is reproduced (for LayerNorm and RMSNorm). ``x``, ``weight`` and ``bias`` are the
    tensors handed to ``F.layer_norm`` / ``F.rms_norm``: one dtype (float32, bfloat16 or float16), the width a
    multiple of 4 up to 2^24, each operand aligned to 4 elements (a non-contiguous ``x`` is copied, aligned, by
    PyTorch first).
    """
    n = x.shape[-1]
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"norm input {x.dtype} (the reproduced kernel reads float32, bfloat16 or float16)"
    if n % VEC or n > MAX_N or n == 0:
        return f"norm width {n} (PyTorch's vectorized kernel needs a multiple of 4 up to 2^24)"
    align = VEC * x.element_size()
    if x.is_contiguous() and x.data_ptr() % align:
        return f"norm input not {align}-byte aligned"
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.data_ptr() % align or t.shape != (n,) or not t.is_contiguous()):
            return f"norm {name} not a contiguous, {align}-byte aligned {x.dtype} vector of {n}"
    return None


_PLANS: dict[tuple, KernelLauncher] = {}
_MAX_PLANS: Final = 256


def _plan(key: tuple, mode: int, x: torch.Tensor, out_dtype: torch.dtype, has_w: bool, has_b: bool,
          table: torch.Tensor | None, emb: torch.Tensor | None, eps: float, stats: bool, mean_order: int,
          index_limit: int) -> KernelLauncher:
    rows, n = x.numel() // x.shape[-1], x.shape[-1]
    s = x.shape[1] if x.dim() == 3 else rows
    if table is not None:
        e4 = _emb4(emb)
        t_k, t_c = table.stride()
        e_b, e_s, e_k, e_c = e4.stride()
        if e4.shape[1] == 1:
            e_s = 0
        wide = needs_int64(x, table, e4, extra=x.numel(), limit=index_limit)
    else:
        t_k = t_c = e_b = e_s = e_k = e_c = 0
        wide = needs_int64(x, extra=x.numel(), limit=index_limit)
    nv = -(-(n // VEC) // THREADS)
    block_c = min(BLOCK_C, max(16, 1 << (n - 1).bit_length()))
    kwargs = dict(MODE=mode, HAS_W=has_w, HAS_B=has_b, OUT_BF16=out_dtype == torch.bfloat16, WRITE_STATS=stats,
                  NV=nv, R=ROWS_PER_PROGRAM, BLOCK_C=block_c, N_CHUNKS=-(-n // block_c),
                  ROW_UNIFORM=table is not None and e_s == 0 and s % ROWS_PER_PROGRAM == 0, MEAN_ORDER=mean_order,
                  APPROX_RSQRT=x.device.type == "cuda", INDEX_64=wide, SOFTWARE_ROUNDING=software_rounding(),
                  **launch_options(NUM_WARPS))
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    grid = (-(-rows // ROWS_PER_PROGRAM),)
    plan = KernelLauncher(_ln_kernel, grid, n_pointers=7,
                          fixed=(rows, s, n, float(eps), t_k, t_c, e_b, e_s, e_k, e_c), constexprs=kwargs)
    _PLANS[key] = plan
    return plan


def _run(mode: int, x: torch.Tensor, eps: float, out_dtype: torch.dtype, weight: torch.Tensor | None,
         bias: torch.Tensor | None, table: torch.Tensor | None, emb: torch.Tensor | None, k0: int, k1: int,
         stats: bool, mean_order: int, index_limit: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    geometry = None if table is None else (table.dtype, table.stride(), emb.dtype, emb.shape, emb.stride())
    # every pointer's dtype is part of the key: a plan's compiled kernels are specialised on them
    key = (mode, x.dtype, x.shape, x.device.type, out_dtype, None if weight is None else weight.dtype,
           None if bias is None else bias.dtype, geometry, eps, stats, mean_order, index_limit)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(key, mode, x, out_dtype, weight is not None, bias is not None, table, emb, eps, stats,
                     mean_order, index_limit)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x.numel() // x.shape[-1]
    st = torch.empty((rows, 2), dtype=torch.float32, device=x.device) if stats else out
    plan((out, st, x, x if weight is None else weight, x if bias is None else bias,
          x if table is None else table, x if emb is None else emb), (k0, k1))
    return out, (st if stats else None)


def layer_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               *, out_dtype: torch.dtype = torch.float32, stats: bool = False, mean_order: int = MEAN_FMA,
               index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.layer_norm(x, (N,), weight, bias, eps)`` rounded to ``out_dtype`` (its ``.to(out_dtype)``).

    Args:
        x: contiguous ``[..., N]`` float32 or bfloat16 (read as float32: bitwise ``x.float()``).
        eps: the LayerNorm epsilon (rounded to float32, as PyTorch does).
        weight, bias: ``[N]`` float32 or ``None``.
        out_dtype: float32 (LayerNorm's own output) or bfloat16 (the eager cast after it).
        stats: also return ``[rows, 2]`` float32 (mean, rstd) per row, as ``native_layer_norm`` returns them.
        mean_order: which product the mean merge contracts (:data:`MEAN_FMA`; other values exist for the probe
            that checks the choice against PyTorch on a GPU).
        index_limit: offsets above this use 64-bit arithmetic (tests lower it).

    Returns:
        ``(out, stats or None)``.
    """
    return _run(MODE_PLAIN, x, eps, out_dtype, weight, bias, None, None, 0, 0, stats, mean_order, index_limit)


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None, *,
             out_dtype: torch.dtype | None = None, stats: bool = False,
             index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.rms_norm(x, (N,), weight, eps)`` as PyTorch's CUDA kernel computes it (float32 accumulation), rounded to
    ``out_dtype`` (default ``x.dtype``, PyTorch's output dtype).

    Args:
        x: contiguous ``[..., N]`` float32, bfloat16 or float16.
        eps: the epsilon (PyTorch's ``RMSNorm(eps=None)`` uses the dtype's machine epsilon: pass it explicitly).
        weight: ``[N]`` of ``x.dtype`` or ``None``.
        stats: also return ``[rows, 2]`` float32 (0, rstd) per row.

    Returns:
        ``(out, stats or None)``.
    """
    return _run(MODE_RMS, x, eps, out_dtype or x.dtype, weight, None, None, None, 0, 0, stats, MEAN_FMA,
                index_limit)


def layer_norm_modulate(x: torch.Tensor, eps: float, table: torch.Tensor, emb: torch.Tensor, k_shift: int,
                        k_scale: int, *, out_dtype: torch.dtype, mean_order: int = MEAN_FMA,
                        index_limit: int = INT32_MAX) -> torch.Tensor:
    """``(layer_norm(x.float()) * (1 + m[k_scale]) + m[k_shift])`` as ``out_dtype``, ``m[k] = table[k] + emb[k]``.

    ``x`` is a contiguous ``[B, S, C]`` stream; ``table`` and ``emb`` as for
    :func:`~worldfoundry.core.fusion.adaln.modulate` (float32 precision: every operation in float32, one rounding).
    """
    return _run(MODE_MODULATE, x, eps, out_dtype, None, None, table, emb, k_shift, k_scale, False, mean_order,
                index_limit)[0]
