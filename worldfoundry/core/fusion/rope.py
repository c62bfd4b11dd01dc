"""Rotary position embedding of Q and K (Wan and SANA-Video attention processors) as one Triton launch.

diffusers 0.42's processors apply, to ``hidden_states`` of shape ``[B, S, H, D]`` and ``freqs_cos/sin`` of shape
``[1, S, 1, D]``::

    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * freqs_cos[..., 0::2] - x2 * freqs_sin[..., 1::2]
    out[..., 1::2] = x1 * freqs_sin[..., 1::2] + x2 * freqs_cos[..., 0::2]

Wan keeps the frequencies in float64 (float32 once a dtype policy keeps ``rope`` in float32; SANA-Video's are cast
to the model dtype, bfloat16), so eager computes each product and the difference/sum in that promoted dtype (each
rounded: separate kernels, no contraction) and the copy into the bfloat16 ``out`` converts float64 to float32 to
bfloat16 (c10's conversion goes through float). :func:`rope_qk` does exactly that, for Q and K in one
launch (eight eager kernels each, sixteen in all, become one).

SANA-Video's linear self-attention additionally applies ``relu`` to Q and K first and then casts the rotated
Q/K and V to float32; :func:`sana_relu_rope` computes all of it in one launch (:func:`reference_sana_relu_rope`).
:func:`sana_normalize` fuses the end of that processor: ``(hidden * (1 / (t + 1e-15))).to(dtype)``.

Outputs are allocated with ``torch.empty_like`` of the tensors eager allocates from, so strides match eager's.
"""

from __future__ import annotations

import logging
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

logger = logging.getLogger(__name__)

#: Rows (token x head vectors) per program of the rotary kernels.
ROWS_PER_PROGRAM: Final = 32

if TRITON_AVAILABLE:

    @triton.jit
    def _rotate_pair(a, b, c, s, COMPUTE: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
        """``(a * c - b * s, a * s + b * c)`` in eager's precision, returned as float32.

        COMPUTE 1 (float64 frequencies): float64 products and sums, then float64 -> float32 (round to nearest, as
        c10 converts double to bfloat16 through float). 0 (float32): float32 throughout. 2 (bfloat16 frequencies
        and inputs): every product and the sum rounded to bfloat16, as eager's bfloat16 kernels do.
        """
        if COMPUTE == 1:
            a64 = a.to(tl.float64)
            b64 = b.to(tl.float64)
            c64 = c.to(tl.float64)
            s64 = s.to(tl.float64)
            return (a64 * c64 - b64 * s64).to(tl.float32), (a64 * s64 + b64 * c64).to(tl.float32)
        af = a.to(tl.float32)
        bf = b.to(tl.float32)
        cf = c.to(tl.float32)
        sf = s.to(tl.float32)
        if COMPUTE == 2:
            even = round_bf16(round_bf16(af * cf, SOFTWARE_ROUNDING) - round_bf16(bf * sf, SOFTWARE_ROUNDING),
                              SOFTWARE_ROUNDING)
            odd = round_bf16(round_bf16(af * sf, SOFTWARE_ROUNDING) + round_bf16(bf * cf, SOFTWARE_ROUNDING),
                             SOFTWARE_ROUNDING)
            return even, odd
        return af * cf - bf * sf, af * sf + bf * cf

    @triton.jit
    def _rotate(x_ptr, o_ptr, bb, sb, hb, pb, mask, c, s, x_b, x_s, x_h, x_d, o_b, o_s, o_h, o_d,
                COMPUTE: tl.constexpr, RELU: tl.constexpr, r_ptr, r_b, r_s, r_h, r_d, WRITE_RELU: tl.constexpr,
                f_ptr, WRITE_F32: tl.constexpr, OUT_BF16: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
        base = x_ptr + bb * x_b + sb * x_s + hb * x_h
        x1 = tl.load(base + (2 * pb) * x_d, mask=mask, other=0.0)
        x2 = tl.load(base + (2 * pb + 1) * x_d, mask=mask, other=0.0)
        if RELU:  # torch.relu: clamp_min(x, 0), NaN kept; compared in float32 (exact for bf16/f32 inputs)
            dt = x1.dtype
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            x1 = tl.where((f1 > 0) | (f1 != f1), f1, 0.0).to(dt)
            x2 = tl.where((f2 > 0) | (f2 != f2), f2, 0.0).to(dt)
            if WRITE_RELU:
                rb = r_ptr + bb * r_b + sb * r_s + hb * r_h
                tl.store(rb + (2 * pb) * r_d, x1, mask=mask)
                tl.store(rb + (2 * pb + 1) * r_d, x2, mask=mask)
        even, odd = _rotate_pair(x1, x2, c, s, COMPUTE, SOFTWARE_ROUNDING)
        ob = o_ptr + bb * o_b + sb * o_s + hb * o_h
        if not WRITE_F32:  # where the float32 copy is written, the rounded rotated tensor itself is not needed
            store_rounded(ob + (2 * pb) * o_d, even, mask, OUT_BF16, SOFTWARE_ROUNDING)
            store_rounded(ob + (2 * pb + 1) * o_d, odd, mask, OUT_BF16, SOFTWARE_ROUNDING)
        if WRITE_F32:  # the float32 value of the rounded output (eager: .float() after the copy)
            if OUT_BF16:
                even = round_bf16(even, SOFTWARE_ROUNDING)
                odd = round_bf16(odd, SOFTWARE_ROUNDING)
            fb = f_ptr + bb * o_b + sb * o_s + hb * o_h
            tl.store(fb + (2 * pb) * o_d, even, mask=mask)
            tl.store(fb + (2 * pb + 1) * o_d, odd, mask=mask)

    @triton.jit
    def _rotate_rows(x_ptr, o_ptr, bb, sb, hb, dd, mask, c, s, x_b, x_s, x_h, o_b, o_s, o_h,
                     COMPUTE: tl.constexpr, RELU: tl.constexpr, r_ptr, r_b, r_s, r_h, WRITE_RELU: tl.constexpr,
                     f_ptr, WRITE_F32: tl.constexpr, OUT_BF16: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
        """:func:`_rotate` for rows whose ``D`` elements are contiguous in every operand: each row is read and
        written whole (vector loads and stores) and split into its (even, odd) pairs in registers -- the same
        operations on the same values, in the same order."""
        x = tl.load(x_ptr + bb * x_b + sb * x_s + hb * x_h + dd, mask=mask, other=0.0)
        if RELU:  # torch.relu: clamp_min(x, 0), NaN kept; compared in float32 (exact for bf16/f32 inputs)
            dt = x.dtype
            fx = x.to(tl.float32)
            x = tl.where((fx > 0) | (fx != fx), fx, 0.0).to(dt)
            if WRITE_RELU:
                tl.store(r_ptr + bb * r_b + sb * r_s + hb * r_h + dd, x, mask=mask)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_R, BLOCK_P, 2)))
        even, odd = _rotate_pair(x1, x2, c, s, COMPUTE, SOFTWARE_ROUNDING)
        if WRITE_F32:  # the float32 value of the rounded output (eager: .float() after the copy)
            if OUT_BF16:
                even = round_bf16(even, SOFTWARE_ROUNDING)
                odd = round_bf16(odd, SOFTWARE_ROUNDING)
            out = tl.reshape(tl.join(even, odd), (BLOCK_R, 2 * BLOCK_P))
            tl.store(f_ptr + bb * o_b + sb * o_s + hb * o_h + dd, out, mask=mask)
        else:
            out = tl.reshape(tl.join(even, odd), (BLOCK_R, 2 * BLOCK_P))
            store_rounded(o_ptr + bb * o_b + sb * o_s + hb * o_h + dd, out, mask, OUT_BF16, SOFTWARE_ROUNDING)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, qr_ptr, kr_ptr, qf_ptr, kf_ptr,
                     v_ptr, vf_ptr, R, S, H, P,
                     q_b, q_s, q_h, q_d, k_b, k_s, k_h, k_d, qo_b, qo_s, qo_h, qo_d, ko_b, ko_s, ko_h, ko_d,
                     qr_b, qr_s, qr_h, qr_d, kr_b, kr_s, kr_h, kr_d, v_b, v_s, v_h, v_d,
                     f_b, f_s, f_d, COMPUTE: tl.constexpr, RELU: tl.constexpr, WRITE_F32: tl.constexpr,
                     WITH_V: tl.constexpr, OUT_BF16: tl.constexpr, INDEX_64: tl.constexpr,
                     SOFTWARE_ROUNDING: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                     ROW_CONTIGUOUS: tl.constexpr = False):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        pairs = tl.arange(0, BLOCK_P)
        if INDEX_64:  # widen before any multiply by a size or stride
            rows = rows.to(tl.int64)
            pairs = pairs.to(tl.int64)
        mask = (rows < R)[:, None] & (pairs < P)[None, :]
        h = rows % H
        t = rows // H
        s = t % S
        b = t // S
        bb = b[:, None]
        sb = s[:, None]
        hb = h[:, None]
        pb = pairs[None, :]
        fbase = bb * f_b + sb * f_s
        if ROW_CONTIGUOUS:  # whole rows: vector loads and stores, pairs split in registers
            dd = tl.arange(0, 2 * BLOCK_P)
            if INDEX_64:
                dd = dd.to(tl.int64)
            dd = dd[None, :]
            rmask = (rows < R)[:, None] & (dd < 2 * P)
            c, _ = tl.split(tl.reshape(tl.load(cos_ptr + fbase + dd * f_d, mask=rmask, other=0.0),
                                       (BLOCK_R, BLOCK_P, 2)))
            _, sn = tl.split(tl.reshape(tl.load(sin_ptr + fbase + dd * f_d, mask=rmask, other=0.0),
                                        (BLOCK_R, BLOCK_P, 2)))
            _rotate_rows(q_ptr, qo_ptr, bb, sb, hb, dd, rmask, c, sn, q_b, q_s, q_h, qo_b, qo_s, qo_h,
                         COMPUTE, RELU, qr_ptr, qr_b, qr_s, qr_h, RELU, qf_ptr, WRITE_F32, OUT_BF16,
                         SOFTWARE_ROUNDING, BLOCK_R, BLOCK_P)
            _rotate_rows(k_ptr, ko_ptr, bb, sb, hb, dd, rmask, c, sn, k_b, k_s, k_h, ko_b, ko_s, ko_h,
                         COMPUTE, RELU, kr_ptr, kr_b, kr_s, kr_h, RELU, kf_ptr, WRITE_F32, OUT_BF16,
                         SOFTWARE_ROUNDING, BLOCK_R, BLOCK_P)
            if WITH_V:
                tl.store(vf_ptr + bb * qo_b + sb * qo_s + hb * qo_h + dd,
                         tl.load(v_ptr + bb * v_b + sb * v_s + hb * v_h + dd, mask=rmask, other=0.0).to(tl.float32),
                         mask=rmask)
        else:  # element pairs with any strides
            c = tl.load(cos_ptr + fbase + (2 * pb) * f_d, mask=mask, other=0.0)
            sn = tl.load(sin_ptr + fbase + (2 * pb + 1) * f_d, mask=mask, other=0.0)
            _rotate(q_ptr, qo_ptr, bb, sb, hb, pb, mask, c, sn, q_b, q_s, q_h, q_d, qo_b, qo_s, qo_h, qo_d,
                    COMPUTE, RELU, qr_ptr, qr_b, qr_s, qr_h, qr_d, RELU, qf_ptr, WRITE_F32, OUT_BF16,
                    SOFTWARE_ROUNDING)
            _rotate(k_ptr, ko_ptr, bb, sb, hb, pb, mask, c, sn, k_b, k_s, k_h, k_d, ko_b, ko_s, ko_h, ko_d,
                    COMPUTE, RELU, kr_ptr, kr_b, kr_s, kr_h, kr_d, RELU, kf_ptr, WRITE_F32, OUT_BF16,
                    SOFTWARE_ROUNDING)
            if WITH_V:  # value.float(), stored with the layout of the rotated outputs
                vb = v_ptr + bb * v_b + sb * v_s + hb * v_h
                ob = vf_ptr + bb * qo_b + sb * qo_s + hb * qo_h
                tl.store(ob + (2 * pb) * qo_d, tl.load(vb + (2 * pb) * v_d, mask=mask, other=0.0).to(tl.float32),
                         mask=mask)
                tl.store(ob + (2 * pb + 1) * qo_d,
                         tl.load(vb + (2 * pb + 1) * v_d, mask=mask, other=0.0).to(tl.float32), mask=mask)

    @triton.jit
    def _normalize_kernel(h_ptr, t_ptr, o_ptr, N, R, eps, INDEX_64: tl.constexpr, OUT_BF16: tl.constexpr,
                          DENOM_BF16: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        group = tl.program_id(2)  # one (b, h): D rows of N, one denominator row of N
        if INDEX_64:
            rows = rows.to(tl.int64)
            cols = cols.to(tl.int64)
            group = group.to(tl.int64)
        mask = (rows < R)[:, None] & (cols < N)[None, :]
        offs = group * R * N + rows[:, None] * N + cols[None, :]
        hs = tl.load(h_ptr + offs, mask=mask, other=0.0)
        z = tl.load(t_ptr + group * N + cols, mask=cols < N, other=1.0).to(tl.float32)
        z = z + eps
        if DENOM_BF16:  # eager's bfloat16 denominator: the add and the reciprocal are each rounded to bfloat16
            z = round_bf16(z, SOFTWARE_ROUNDING)
        z = tl.div_rn(tl.full(z.shape, 1.0, tl.float32), z)
        if DENOM_BF16:
            z = round_bf16(z, SOFTWARE_ROUNDING)
        store_rounded(o_ptr + offs, hs * z[None, :], mask, OUT_BF16, SOFTWARE_ROUNDING)


def _strides4(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride(), strict=True))  # type: ignore[return-value]


def compute_mode(x: torch.Tensor, freqs: torch.Tensor) -> int:
    """The kernel's ``COMPUTE`` for eager's promoted dtype of ``x * freqs`` (float32 0, float64 1, bfloat16 2).

    Raises:
        ValueError: another promoted dtype (float16), which the kernel does not reproduce.
    """
    dtype = torch.promote_types(x.dtype, freqs.dtype)
    modes = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}
    if dtype not in modes:
        raise ValueError(f"rotary compute dtype {dtype} is not float32/float64/bfloat16")
    return modes[dtype]


def row_contiguous(*tensors: torch.Tensor | None) -> bool:
    """Whether every given ``[B, S, H, D]`` operand has its ``D`` elements contiguous (stride 1, or size 1)."""
    return all(t is None or t.shape[-1] == 1 or t.stride(-1) == 1 for t in tensors)


#: ``[True]`` turns the row-contiguous variant off: tests (to check the element-pair variant on the same operands)
#: and a first launch where it fails to compile (the process then keeps to the element-pair variant).
_STRIDED_ONLY: list[bool] = [False]


#: Launch plans by operand geometry (as in :mod:`~worldfoundry.core.fusion.adaln`).
_PLANS: dict[tuple, KernelLauncher] = {}
_MAX_PLANS: Final = 512


def _plan(q, k, cos, sin, qo, ko, relu_q, relu_k, qf, kf, v, vf, index_limit) -> KernelLauncher:
    bsz, s, h, d = q.shape
    rows = bsz * s * h
    pairs = d // 2
    block_p = max(16, 1 << (pairs - 1).bit_length())
    block_r = max(1, min(ROWS_PER_PROGRAM, 4096 // block_p))
    relu = relu_q is not None
    f_b, f_s, _, f_d = _strides4(cos)
    if _strides4(sin) != _strides4(cos) or cos.shape != sin.shape:
        raise ValueError("freqs_cos and freqs_sin differ in shape or strides; use the reference")
    wide = needs_int64(q, k, qo, ko, cos, sin, relu_q, relu_k, qf, kf, v, vf, extra=q.numel(), limit=index_limit)
    zero4 = (0, 0, 0, 0)
    ints = (rows, s, h, pairs, *q.stride(), *k.stride(), *qo.stride(), *ko.stride(),
            *(relu_q.stride() if relu else zero4), *(relu_k.stride() if relu else zero4),
            *(v.stride() if v is not None else zero4), f_b, f_s, f_d)
    kwargs = dict(COMPUTE=compute_mode(q, cos), RELU=relu, WRITE_F32=qf is not None, WITH_V=v is not None,
                  OUT_BF16=q.dtype == torch.bfloat16, INDEX_64=wide, SOFTWARE_ROUNDING=software_rounding(),
                  BLOCK_R=block_r, BLOCK_P=block_p,
                  ROW_CONTIGUOUS=row_contiguous(q, k, qo, ko, relu_q, relu_k, qf, kf, v, vf) and not _STRIDED_ONLY[0],
                  **launch_options())
    grid = (-(-rows // block_r),)  # plain ints: triton.cdiv is a slow constexpr function
    return KernelLauncher(_rope_kernel, grid, n_pointers=12, fixed=ints, constexprs=kwargs)


def _launch(q, k, cos, sin, qo, ko, *, relu_q=None, relu_k=None, qf=None, kf=None, v=None, vf=None,
            index_limit=INT32_MAX) -> None:
    # the outputs are allocated from q/k/v by the callers (``empty_like``), so the inputs' geometry decides theirs
    key = (q.dtype, q.shape, q.stride(), k.dtype, k.shape, k.stride(), cos.dtype, cos.shape, cos.stride(),
           sin.dtype, sin.shape, sin.stride(), qo.dtype, qo.stride(), ko.stride(), relu_q is not None,
           qf is not None, None if v is None else (v.dtype, v.stride()), index_limit, _STRIDED_ONLY[0])
    plan = _PLANS.get(key)
    fresh = plan is None
    if fresh:
        plan = _plan(q, k, cos, sin, qo, ko, relu_q, relu_k, qf, kf, v, vf, index_limit)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    relu = relu_q is not None
    args = (q, k, qo, ko, cos, sin, relu_q if relu else qo, relu_k if relu else ko, qf if qf is not None else qo,
            kf if kf is not None else ko, v if v is not None else q, vf if vf is not None else qo)
    try:
        plan(args)
    except Exception as exc:  # the row variant failing to compile here: the element-pair variant, said once
        if not (fresh and plan._kwargs.get("ROW_CONTIGUOUS")):
            raise
        logger.warning("rotary kernel: the row-contiguous variant failed (%s: %s); using the element-pair variant",
                       type(exc).__name__, exc)
        _STRIDED_ONLY[0] = True
        _PLANS.pop(key, None)
        _launch(q, k, cos, sin, qo, ko, relu_q=relu_q, relu_k=relu_k, qf=qf, kf=kf, v=v, vf=vf,
                index_limit=index_limit)


def rope_qk(query: torch.Tensor, key: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, *,
            index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's ``apply_rotary_emb`` of ``query`` and ``key`` in one launch.

    Args:
        query, key: ``[B, S, H, D]`` (any strides; e.g. chunks of a packed QKV output), bfloat16 or float32.
        freqs_cos, freqs_sin: ``[1 or B, S, 1, D]`` float64 or float32.
        index_limit: offsets above this use 64-bit arithmetic (tests lower it).

    Returns:
        ``(query_rotated, key_rotated)``, allocated like eager (``torch.empty_like``).
    """
    qo, ko = torch.empty_like(query), torch.empty_like(key)
    _launch(query, key, freqs_cos, freqs_sin, qo, ko, index_limit=index_limit)
    return qo, ko


def reference_rope(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """The rotary function of diffusers 0.42's Wan / SANA-Video processors, operation for operation."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def reference_rope_qk(query: torch.Tensor, key: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, *,
                      index_limit: int = INT32_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rope_qk`."""
    return reference_rope(query, freqs_cos, freqs_sin), reference_rope(key, freqs_cos, freqs_sin)


def sana_relu_rope(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None, freqs_cos: torch.Tensor,
                   freqs_sin: torch.Tensor, *, index_limit: int = INT32_MAX) -> tuple[torch.Tensor | None, ...]:
    """SANA-Video linear attention's ``relu`` of Q/K, rotary of both and float32 casts, in one launch.

    Args:
        query, key: ``[B, N, H, D]`` after the Q/K norms (any strides).
        value: ``[B, N, H, D]`` with the layout of ``torch.empty_like(query)`` (so that its float32 copy has the
            layout eager's ``value.permute(...).float()`` has), or ``None`` to leave that cast to the caller.
        freqs_cos, freqs_sin: as :func:`rope_qk`.
        index_limit: offsets above this use 64-bit arithmetic (tests lower it).

    Returns:
        ``(relu(query), relu(key), rope(relu(query)).float(), rope(relu(key)).float(), value.float() or None)``,
        each in the ``[B, N, H, D]`` order with the strides eager's tensors have before their permutes.

    Raises:
        ValueError: ``value``'s layout differs from the rotated outputs' layout.
    """
    rq, rk = torch.empty_like(query), torch.empty_like(key)
    # eager's rotated tensors are ``empty_like(relu(x))`` (the layout of rq/rk); only their float32 copies are used,
    # so the kernel writes those alone (with that layout), not the rounded rotated tensors themselves
    qf = torch.empty_like(rq, dtype=torch.float32)
    kf = torch.empty_like(rk, dtype=torch.float32)
    vf = None
    if value is not None:
        vf = torch.empty_like(value, dtype=torch.float32)
        if vf.stride() != qf.stride() or value.shape != query.shape:
            raise ValueError("value and query layouts differ; cast value separately")
    _launch(query, key, freqs_cos, freqs_sin, qf, kf, relu_q=rq, relu_k=rk, qf=qf, kf=kf, v=value, vf=vf,
            index_limit=index_limit)
    return rq, rk, qf, kf, vf


def reference_sana_relu_rope(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                             freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, *,
                             index_limit: int = INT32_MAX) -> tuple[torch.Tensor | None, ...]:
    """Torch reference of :func:`sana_relu_rope` (the processor's operations)."""
    rq, rk = torch.relu(query), torch.relu(key)
    qo, ko = reference_rope(rq, freqs_cos, freqs_sin), reference_rope(rk, freqs_cos, freqs_sin)
    return rq, rk, qo.float(), ko.float(), (value.float() if value is not None else None)


#: Launch plans of :func:`sana_normalize` (contiguous operands: shapes and dtypes are the geometry).
_NORMALIZE_PLANS: dict[tuple, KernelLauncher] = {}


def sana_normalize(hidden: torch.Tensor, denom: torch.Tensor, out_dtype: torch.dtype, *, eps: float = 1e-15,
                   index_limit: int = INT32_MAX) -> torch.Tensor:
    """``(hidden * (1 / (denom + eps))).to(out_dtype)`` in one launch (eager: four kernels and the cast).

    Args:
        hidden: ``[B, H, D, N]`` contiguous float32 (``scores @ query_rotate``).
        denom: ``[B, H, 1, N]`` contiguous (``key_sum^T @ query``; bfloat16 when Q/K are bfloat16: then the add
            of ``eps`` and the reciprocal are rounded to bfloat16 as eager's kernels round them).
        out_dtype: bfloat16 or float32.
        eps: the processor's ``1e-15`` (added in float32).

    Returns:
        ``[B, H, D, N]`` contiguous tensor of ``out_dtype`` (eager's ``.to`` keeps the layout of its input).
    """
    out = torch.empty(hidden.shape, dtype=out_dtype, device=hidden.device)
    key = (hidden.shape, hidden.stride(), hidden.dtype, denom.shape, denom.stride(), denom.dtype, out_dtype, eps,
           index_limit)
    plan = _NORMALIZE_PLANS.get(key)
    if plan is None:
        if denom.dtype not in (torch.bfloat16, torch.float32) or hidden.dtype != torch.float32:
            raise ValueError(f"sana_normalize needs a float32 hidden and a bfloat16/float32 denominator, got "
                             f"{hidden.dtype} / {denom.dtype}")
        bsz, h, d, n = hidden.shape
        block_n = 256 if n >= 256 else max(16, 1 << (n - 1).bit_length())
        block_r = max(1, min(d, 4096 // block_n))
        block_r = 1 << (block_r.bit_length() - 1)
        wide = needs_int64(hidden, denom, out, extra=hidden.numel(), limit=index_limit)
        grid = (-(-d // block_r), -(-n // block_n), bsz * h)  # plain ints (triton.cdiv is slow)
        kwargs = dict(INDEX_64=wide, OUT_BF16=out_dtype == torch.bfloat16, DENOM_BF16=denom.dtype == torch.bfloat16,
                      SOFTWARE_ROUNDING=software_rounding(), BLOCK_R=block_r, BLOCK_N=block_n, **launch_options())
        plan = KernelLauncher(_normalize_kernel, grid, n_pointers=3, fixed=(n, d, eps), constexprs=kwargs)
        if len(_NORMALIZE_PLANS) >= _MAX_PLANS:
            _NORMALIZE_PLANS.clear()
        _NORMALIZE_PLANS[key] = plan
    plan((hidden, denom, out))
    return out


def reference_sana_normalize(hidden: torch.Tensor, denom: torch.Tensor, out_dtype: torch.dtype, *,
                             eps: float = 1e-15, index_limit: int = INT32_MAX) -> torch.Tensor:
    """Torch reference of :func:`sana_normalize` (the processor's ``z = 1 / (t + 1e-15)``; ``hidden * z``)."""
    z = 1 / (denom + eps)
    return (hidden * z).to(out_dtype)


__all__ = [
    "reference_rope",
    "reference_rope_qk",
    "reference_sana_normalize",
    "reference_sana_relu_rope",
    "rope_qk",
    "sana_normalize",
    "sana_relu_rope",
]
