"""Wan's across-heads RMSNorm of Q and K followed by the rotary embedding, as one Triton launch, bitwise eager.

diffusers 0.42's ``WanAttnProcessor`` runs, after the projections (``C = H * D``)::

    query = attn.norm_q(query)                       # torch.nn.RMSNorm(C, eps, elementwise_affine=True)
    key = attn.norm_k(key)
    query = query.unflatten(2, (attn.heads, -1))     # [B, S, H, D]
    key = key.unflatten(2, (attn.heads, -1))
    query = apply_rotary_emb(query, *rotary_emb)     # freqs_cos / freqs_sin [1, S, 1, D], float64 in Wan
    key = apply_rotary_emb(key, *rotary_emb)

:func:`rms_norm_rope_qk` computes both chains in one kernel launch: program axis 1 picks Q or K, and each program
normalises ``R`` token rows of ``C`` elements and rotates them in place in registers.

**What is reproduced.** The row statistics are PyTorch's CUDA RMSNorm reduction (the vectorized kernel's 128
per-thread sums of squares and their merge tree, :func:`~worldfoundry.core.fusion.layer_norm._row_stats`); the
normalised value is ``weight * (rstd * x)`` rounded to the input dtype, as eager's RMSNorm writes it. The rotary
then reads those rounded values and computes in the promoted dtype of input and frequencies (float64 for Wan's
float64 frequencies: products, difference and sum each rounded in float64, then float64 -> float32 -> input dtype;
float32 frequencies: float32 throughout), exactly as eager's separate kernels do
(:func:`~worldfoundry.core.fusion.rope._rotate_pair`). The kernel is compiled without floating-point contraction.
Eager writes the contiguous ``[B, S, C]`` norm output and allocates the rotary output with ``empty_like``, so the
output here is a contiguous ``[B, S, H, D]`` tensor, eager's layout.

PyTorch runs that reduction only when its vectorized RMSNorm kernel is taken (width a multiple of 4 up to 2^24,
aligned operands); :func:`reason` says when the operands leave that path or the kernel's scope. As for
:mod:`~worldfoundry.core.fusion.layer_norm`, Triton's interpreter (CPU, ``TRITON_INTERPRET=1``) computes ``rsqrt`` as
``1 / sqrt`` in float64, which :func:`reference_rms_norm_rope_qk` matches with ``approx_rsqrt=False``; on a CUDA GPU
the kernel is checked against eager itself.

Example (CPU, interpreter)::

    q, k = torch.randn(1, 6, 64).bfloat16(), torch.randn(1, 6, 64).bfloat16()
    w = torch.ones(64, dtype=torch.bfloat16)
    cos, sin = torch.rand(1, 6, 1, 32, dtype=torch.float64), torch.rand(1, 6, 1, 32, dtype=torch.float64)
    assert reason(q, k, w, w, cos, sin, 2) is None
    q_out, k_out = rms_norm_rope_qk(q, k, w, w, 1e-6, 1e-6, 2, cos, sin)   # [1, 6, 2, 32] each
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.core.fusion.indexing import INT32_MAX, needs_int64
from worldfoundry.core.fusion.launch import KernelLauncher
from worldfoundry.core.fusion.layer_norm import THREADS, VEC, torch_path_reason
from worldfoundry.core.fusion.layer_norm_reference import reference_rms_norm
from worldfoundry.core.fusion.rope import compute_mode, reference_rope
from worldfoundry.core.fusion.triton_support import (
    TRITON_AVAILABLE,
    launch_options,
    round_bf16,
    software_rounding,
    store_rounded,
    tl,
    triton,
)

#: Input dtypes the kernel takes (Q, K and their weights all of one).
QK_DTYPES: Final = (torch.bfloat16, torch.float32)
#: Frequency dtypes the kernel takes (cos and sin of one).
FREQ_DTYPES: Final = (torch.float64, torch.float32)
#: Token rows per program, channels per chunk of the output pass (at most), warps per program.
ROWS_PER_PROGRAM: Final = 8
BLOCK_C: Final = 128  # 512 took 3x as long to compile (float64 rotary on [8, 512] tiles): a first call waits for it
NUM_WARPS: Final = 8

if TRITON_AVAILABLE:
    from worldfoundry.core.fusion.layer_norm import _row_stats
    from worldfoundry.core.fusion.rope import _rotate_pair

    @triton.jit
    def _norm_rope_rows(x_ptr, w_ptr, o_ptr, cos_ptr, sin_ptr, rows, live_rows, N, x_rs, D, S, eps, f_b, f_s,
                        f_d, R: tl.constexpr, NV: tl.constexpr, BLOCK_C: tl.constexpr, N_CHUNKS: tl.constexpr,
                        COMPUTE: tl.constexpr, OUT_BF16: tl.constexpr, APPROX_RSQRT: tl.constexpr,
                        INDEX_64: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
        """RMSNorm (weighted, rounded to the input dtype) then the rotary of ``R`` rows of ``N`` contiguous elements
        (input rows ``x_rs`` apart; the output is contiguous)."""
        _, rstd = _row_stats(x_ptr, rows, live_rows, N, x_rs, eps, R, NV, 0, APPROX_RSQRT, True)
        bs = rows // S
        ss = rows - bs * S
        fbase = (bs * f_b + ss * f_s)[:, None]
        HALF: tl.constexpr = BLOCK_C // 2
        for chunk in tl.range(0, N_CHUNKS, loop_unroll_factor=1):  # chunks are independent: a loop, not unrolled
            cols = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
            even = chunk * BLOCK_C + 2 * tl.arange(0, HALF)
            if INDEX_64:
                cols = cols.to(tl.int64)
                even = even.to(tl.int64)
            cmask = cols < N
            mask = live_rows[:, None] & cmask[None, :]
            offs = rows[:, None] * N + cols[None, :]
            x = tl.load(x_ptr + rows[:, None] * x_rs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            y = rstd * x  # PyTorch's RMSNorm epilogue: rstd * x, then weight * that, rounded to the output dtype
            y = w * y
            if OUT_BF16:  # eager's norm writes bfloat16; the rotary reads those values
                y = round_bf16(y, SOFTWARE_ROUNDING)
            a, b = tl.split(tl.reshape(y, (R, HALF, 2)))
            d = (even % D)[None, :]  # head-dim index of each pair's even element (D is even: pairs stay in a head)
            pmask = live_rows[:, None] & (even < N)[None, :]
            c = tl.load(cos_ptr + fbase + d * f_d, mask=pmask, other=0.0)  # cos[..., 0::2]
            s = tl.load(sin_ptr + fbase + (d + 1) * f_d, mask=pmask, other=0.0)  # sin[..., 1::2]
            out_even, out_odd = _rotate_pair(a, b, c, s, COMPUTE, SOFTWARE_ROUNDING)
            out = tl.reshape(tl.join(out_even, out_odd), (R, BLOCK_C))
            store_rounded(o_ptr + offs, out, mask, OUT_BF16, SOFTWARE_ROUNDING)

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, M, S, N, q_rs, k_rs, D,
                             eps_q, eps_k, f_b, f_s, f_d, R: tl.constexpr, NV: tl.constexpr, BLOCK_C: tl.constexpr,
                             N_CHUNKS: tl.constexpr, COMPUTE: tl.constexpr, OUT_BF16: tl.constexpr,
                             APPROX_RSQRT: tl.constexpr, INDEX_64: tl.constexpr,
                             SOFTWARE_ROUNDING: tl.constexpr):
        rows = tl.program_id(0) * R + tl.arange(0, R)
        if INDEX_64:  # widen before any multiply by a size or stride
            rows = rows.to(tl.int64)
        live_rows = rows < M
        if tl.program_id(1) == 0:
            _norm_rope_rows(q_ptr, wq_ptr, qo_ptr, cos_ptr, sin_ptr, rows, live_rows, N, q_rs, D, S, eps_q, f_b, f_s,
                            f_d, R, NV, BLOCK_C, N_CHUNKS, COMPUTE, OUT_BF16, APPROX_RSQRT, INDEX_64,
                            SOFTWARE_ROUNDING)
        else:
            _norm_rope_rows(k_ptr, wk_ptr, ko_ptr, cos_ptr, sin_ptr, rows, live_rows, N, k_rs, D, S, eps_k, f_b, f_s,
                            f_d, R, NV, BLOCK_C, N_CHUNKS, COMPUTE, OUT_BF16, APPROX_RSQRT, INDEX_64,
                            SOFTWARE_ROUNDING)


def _freqs_strides(cos: torch.Tensor) -> tuple[int, int, int]:
    """``(batch, token, dim)`` strides of ``[1|B, S, 1, D]`` frequencies (0 for a size-1 dimension)."""
    return tuple(0 if size == 1 else stride  # type: ignore[return-value]
                 for i, (size, stride) in enumerate(zip(cos.shape, cos.stride(), strict=True)) if i != 2)


def row_stride(x: torch.Tensor) -> int | None:
    """The distance between rows when ``x`` ``[B, S, C]`` is ``B * S`` rows of ``C`` contiguous elements at one
    stride (a contiguous tensor: ``C``; a chunk of a packed projection output such as fused Q/K/V: its token
    stride), or ``None`` when it is not."""
    if x.dim() != 3:
        return None
    b, s, c = x.shape
    if x.is_contiguous():
        return c
    if x.stride(2) != 1:
        return None
    if s == 1:
        stride = x.stride(0)
    else:
        stride = x.stride(1)
        if b > 1 and x.stride(0) != s * stride:
            return None
    return stride if stride >= c else None


def _geometry_reason(query: torch.Tensor, key: torch.Tensor, weight_q: torch.Tensor, weight_k: torch.Tensor,
                     freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, heads: int) -> str | None:
    """The shape, dtype, layout and device part of :func:`reason` (what a launch plan fixes)."""
    if query.dtype not in QK_DTYPES or key.dtype != query.dtype:
        return f"query/key dtype {query.dtype}/{key.dtype} (the kernel takes bfloat16 or float32, both the same)"
    if query.dim() != 3 or key.shape != query.shape:
        return f"query/key shapes {tuple(query.shape)}/{tuple(key.shape)} are not one [B, S, C]"
    if row_stride(query) is None or row_stride(key) is None:
        return "query or key rows are not evenly spaced runs of contiguous channels"
    bsz, s, c = query.shape
    if heads <= 0 or c % heads:
        return f"width {c} not divisible by {heads} heads"
    d = c // heads
    if d % 2:
        return f"odd head dim {d} (the rotary pairs elements)"
    for name, w in (("weight_q", weight_q), ("weight_k", weight_k)):
        if w.dtype != query.dtype or w.shape != (c,) or not w.is_contiguous():
            return f"{name} not a contiguous {query.dtype} vector of {c}"
    if freqs_cos.dtype not in FREQ_DTYPES or freqs_sin.dtype != freqs_cos.dtype:
        return f"freqs dtype {freqs_cos.dtype}/{freqs_sin.dtype} (the kernel takes float64 or float32, both the same)"
    if (freqs_cos.dim() != 4 or freqs_cos.shape[0] not in (1, bsz) or tuple(freqs_cos.shape[1:]) != (s, 1, d)
            or freqs_sin.shape != freqs_cos.shape):
        return f"freqs shapes {tuple(freqs_cos.shape)}/{tuple(freqs_sin.shape)} are not [1 or {bsz}, {s}, 1, {d}]"
    if _freqs_strides(freqs_cos) != _freqs_strides(freqs_sin):
        return "freqs_cos and freqs_sin have different strides"
    devices = {t.device for t in (query, key, weight_q, weight_k, freqs_cos, freqs_sin)}
    if len(devices) != 1:
        return f"operands on several devices ({', '.join(sorted(str(x) for x in devices))})"
    return None


def reason(query: torch.Tensor, key: torch.Tensor, weight_q: torch.Tensor, weight_k: torch.Tensor,
           freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, heads: int) -> str | None:
    """Why :func:`rms_norm_rope_qk` cannot reproduce eager for these operands (``None`` when it can).

    The operands as the processor holds them: ``query``/``key`` ``[B, S, C]`` bfloat16 or float32 whose rows are
    ``C`` contiguous elements at one stride (:func:`row_stride`: contiguous, or chunks of a fused projection),
    ``weight_q``/``weight_k`` contiguous ``[C]`` of that dtype, ``freqs_cos``/``freqs_sin`` ``[1 or B, S, 1, D]``
    float64 or float32 with equal strides, ``C = heads * D`` with ``D`` even, all on one device; and PyTorch must
    be about to take the vectorized RMSNorm kernel the statistics reproduce
    (:func:`~worldfoundry.core.fusion.layer_norm.torch_path_reason`: ``C`` a multiple of 4 up to 2^24, Q, K and
    the weights aligned to 4 elements). The device type is not checked (callers check that Triton can run there
    and that eager's RMSNorm is PyTorch's CUDA kernel).

    Returns:
        A one-line reason, or ``None``.
    """
    geometry = _geometry_reason(query, key, weight_q, weight_k, freqs_cos, freqs_sin, heads)
    if geometry is not None:
        return geometry
    path = torch_path_reason(query, weight_q) or torch_path_reason(key, weight_k)
    return None if path is None else f"rms_norm: {path}"


_PLANS: dict[tuple, KernelLauncher] = {}
_MAX_PLANS: Final = 256


def _plan(query: torch.Tensor, key: torch.Tensor, weight_q: torch.Tensor, weight_k: torch.Tensor, eps_q: float,
          eps_k: float, heads: int, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
          index_limit: int) -> KernelLauncher:
    why = _geometry_reason(query, key, weight_q, weight_k, freqs_cos, freqs_sin, heads)
    if why is not None:
        raise ValueError(f"rms_norm_rope_qk: {why}; use the eager path")
    bsz, s, n = query.shape
    rows = bsz * s
    f_b, f_s, f_d = _freqs_strides(freqs_cos)
    wide = needs_int64(query, key, freqs_cos, freqs_sin, extra=query.numel(), limit=index_limit)
    block_c = min(BLOCK_C, max(16, 1 << (n - 1).bit_length()))
    kwargs = dict(R=ROWS_PER_PROGRAM, NV=-(-(n // VEC) // THREADS), BLOCK_C=block_c, N_CHUNKS=-(-n // block_c),
                  COMPUTE=compute_mode(query, freqs_cos), OUT_BF16=query.dtype == torch.bfloat16,
                  APPROX_RSQRT=query.device.type == "cuda", INDEX_64=wide, SOFTWARE_ROUNDING=software_rounding(),
                  **launch_options(NUM_WARPS))
    grid = (-(-rows // ROWS_PER_PROGRAM), 2)  # axis 1: 0 query, 1 key
    return KernelLauncher(_qk_norm_rope_kernel, grid, n_pointers=8,
                          fixed=(rows, s, n, row_stride(query), row_stride(key), n // heads, float(eps_q),
                                 float(eps_k), f_b, f_s, f_d),
                          constexprs=kwargs)


def rms_norm_rope_qk(query: torch.Tensor, key: torch.Tensor, weight_q: torch.Tensor, weight_k: torch.Tensor,
                     eps_q: float, eps_k: float, heads: int, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, *,
                     index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_emb(norm(x).unflatten(2, (heads, -1)), cos, sin)`` for Q and K in one launch.

    Args:
        query, key: ``[B, S, C]`` bfloat16 or float32, rows of contiguous channels at one stride (:func:`row_stride`:
            the projections' outputs, separate or chunks of a fused Q/K/V).
        weight_q, weight_k: the RMSNorm weights, contiguous ``[C]`` of the input dtype.
        eps_q, eps_k: the RMSNorm epsilons (rounded to float32, as PyTorch does).
        heads: ``H``; ``C // heads`` is the (even) head dim ``D``.
        freqs_cos, freqs_sin: ``[1 or B, S, 1, D]`` float64 or float32, equal strides.
        index_limit: offsets above this use 64-bit arithmetic (tests lower it).

    Returns:
        ``(query_out, key_out)``, contiguous ``[B, S, heads, D]`` of the input dtype.

    Raises:
        ValueError: operands outside the kernel's scope (:func:`reason`, less PyTorch's path conditions, which
            the caller checks).
    """
    plan_key = (query.dtype, query.shape, query.stride(), key.shape, key.stride(), query.device.type,
                weight_q.dtype, weight_q.shape, weight_q.stride(), weight_k.dtype, weight_k.shape, weight_k.stride(),
                eps_q, eps_k, heads, freqs_cos.dtype, freqs_cos.shape, freqs_cos.stride(), freqs_sin.dtype,
                freqs_sin.shape, freqs_sin.stride(), index_limit)
    plan = _PLANS.get(plan_key)
    if plan is None:
        plan = _plan(query, key, weight_q, weight_k, eps_q, eps_k, heads, freqs_cos, freqs_sin, index_limit)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[plan_key] = plan
    bsz, s, n = query.shape
    q_out = torch.empty((bsz, s, heads, n // heads), dtype=query.dtype, device=query.device)
    k_out = torch.empty((bsz, s, heads, n // heads), dtype=key.dtype, device=key.device)
    plan((query, key, weight_q, weight_k, q_out, k_out, freqs_cos, freqs_sin))
    return q_out, k_out


def reference_rms_norm_rope_qk(query: torch.Tensor, key: torch.Tensor, weight_q: torch.Tensor,
                               weight_k: torch.Tensor, eps_q: float, eps_k: float, heads: int,
                               freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, *, approx_rsqrt: bool = False,
                               index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rms_norm_rope_qk`: the reproduced RMSNorm
    (:func:`~worldfoundry.core.fusion.layer_norm_reference.reference_rms_norm`), ``unflatten``, and the processor's
    rotary (:func:`~worldfoundry.core.fusion.rope.reference_rope`). ``approx_rsqrt=False`` matches the kernel under
    Triton's interpreter bitwise; ``True`` uses ``torch.rsqrt``. On CUDA tensors the reference is close to, not
    bitwise, eager: ``reference_row_stats`` divides by a CPU scalar tensor, which PyTorch's CUDA division turns into
    a multiplication by the reciprocal (the kernel and eager divide). ``index_limit`` is accepted for signature
    parity and unused."""
    q = reference_rms_norm(query, eps_q, weight_q, approx_rsqrt=approx_rsqrt).unflatten(2, (heads, -1))
    k = reference_rms_norm(key, eps_k, weight_k, approx_rsqrt=approx_rsqrt).unflatten(2, (heads, -1))
    return reference_rope(q, freqs_cos, freqs_sin), reference_rope(k, freqs_cos, freqs_sin)


__all__ = ["FREQ_DTYPES", "QK_DTYPES", "reason", "reference_rms_norm_rope_qk", "rms_norm_rope_qk", "row_stride"]
