"""Torch reference of :mod:`worldfoundry.core.fusion.layer_norm`: PyTorch's vectorized CUDA LayerNorm, step by step.

The same 128 per-thread Welford states, the same merge tree and the same fused multiply-adds, written with torch
operations so that it runs anywhere. A fused multiply-add is computed exactly (float64 product and sum, then a
correction where rounding twice would differ from rounding once). ``approx_rsqrt=False`` computes ``1 / sqrt`` in
float64 and rounds it to float32 (what Triton's interpreter computes for the kernel's CPU path); ``True`` uses
``torch.rsqrt`` of the tensor's device.
"""

from __future__ import annotations

import torch

from worldfoundry.core.fusion.layer_norm import THREADS, VEC, WARP


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to float32 (float32 operands, broadcast)."""
    a, b, c = torch.broadcast_tensors(a, b, c)
    p = a.double() * b.double()  # exact: 24 + 24 bits
    cd = c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)  # s + err == p + c exactly (two-sum)
    r = s.float()
    d = s - r.double()
    toward = torch.where(d > 0, torch.full_like(r, float("inf")), torch.full_like(r, float("-inf")))
    nxt = torch.nextafter(r, toward)
    tie = (d != 0) & (2 * d == nxt.double() - r.double())
    return torch.where(tie & (torch.sign(err) == torch.sign(d)), nxt, r)


def _combine(b: tuple[torch.Tensor, ...], a: tuple[torch.Tensor, ...], mean_order: int) -> tuple[torch.Tensor, ...]:
    b_mean, b_m2, b_n = b
    a_mean, a_m2, a_n = a
    delta = b_mean - a_mean
    count = a_n + b_n
    coef = 1.0 / torch.where(count > 0, count, torch.ones_like(count))
    n_a = a_n * coef
    n_b = b_n * coef
    if mean_order == 0:
        mean = fma32(n_a, a_mean, n_b * b_mean)
    elif mean_order == 1:
        mean = fma32(n_b, b_mean, n_a * a_mean)
    else:
        mean = n_a * a_mean + n_b * b_mean
    m2 = fma32(delta * delta * a_n, n_b, a_m2 + b_m2)
    zero = torch.zeros_like(mean)
    return torch.where(count > 0, mean, zero), torch.where(count > 0, m2, zero), count


def _halve(state: tuple[torch.Tensor, ...], half: int, mean_order: int, merge) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    own = tuple(t[..., :half] for t in state)
    other = tuple(t[..., half:2 * half] for t in state)
    return merge(own, other, mean_order)


def reference_row_stats(x: torch.Tensor, eps: float, *, mean_order: int = 0, approx_rsqrt: bool = False,
                        rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd) per row of ``x`` (``[..., N]``, read as float32), each ``[rows]`` float32 (RMSNorm: mean 0)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n).float()
    r = rows.shape[0]
    n_vec = n // VEC
    mean, m2, count = (torch.zeros(r, THREADS, dtype=torch.float32, device=x.device) for _ in range(3))
    t = torch.arange(THREADS, device=x.device)
    for i in range(-(-n_vec // THREADS)):
        v_idx = i * THREADS + t
        live = (v_idx < n_vec).expand(r, THREADS)
        for ii in range(VEC):
            val = rows[:, torch.clamp(v_idx * VEC + ii, max=n - 1)]
            if rms:
                m2 = torch.where(live, fma32(val, val, m2), m2)
                continue
            delta = val - mean
            new_n = count + 1.0
            new_mean = fma32(delta, 1.0 / new_n, mean)
            new_m2 = fma32(delta, val - new_mean, m2)
            mean, m2, count = (torch.where(live, a, b) for a, b in ((new_mean, mean), (new_m2, m2), (new_n, count)))
    state = tuple(s.reshape(r, THREADS // WARP, WARP) for s in (mean, m2, count))
    merge = _sum_squares if rms else _combine
    for half in (16, 8, 4, 2, 1):
        state = _halve(state, half, mean_order, merge)
    state = tuple(s.reshape(r, THREADS // WARP) for s in state)
    for half in (2, 1):
        state = _halve(state, half, mean_order, merge)
    mean, m2 = state[0][:, 0], state[1][:, 0]
    # divisors on m2's device: a CUDA tensor divided by a CPU scalar tensor is multiplied by its (inexact) reciprocal
    var = m2 / torch.full_like(m2, float(n))
    v = var + torch.full_like(var, eps)
    rstd = torch.rsqrt(v) if approx_rsqrt else (1.0 / torch.sqrt(v.double())).float()
    return mean, rstd


def _sum_squares(b: tuple[torch.Tensor, ...], a: tuple[torch.Tensor, ...], mean_order: int) -> tuple[torch.Tensor, ...]:
    return b[0], b[1] + a[1], b[2]


def reference_rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None, *,
                       out_dtype: torch.dtype | None = None, approx_rsqrt: bool = False) -> torch.Tensor:
    """Reference of :func:`~worldfoundry.core.fusion.layer_norm.rms_norm`."""
    _, rstd = reference_row_stats(x, eps, approx_rsqrt=approx_rsqrt, rms=True)
    y = rstd.reshape(*x.shape[:-1], 1) * x.float()
    if weight is not None:
        y = weight.float() * y
    return y.to(out_dtype or x.dtype)


def reference_layer_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.float32,
                         mean_order: int = 0, approx_rsqrt: bool = False) -> torch.Tensor:
    """Reference of :func:`~worldfoundry.core.fusion.layer_norm.layer_norm`."""
    mean, rstd = reference_row_stats(x, eps, mean_order=mean_order, approx_rsqrt=approx_rsqrt)
    shape = (*x.shape[:-1], 1)
    y = rstd.reshape(shape) * (x.float() - mean.reshape(shape))
    if weight is not None and bias is not None:
        y = fma32(weight.float(), y, bias.float())
    elif weight is not None:
        y = weight.float() * y
    elif bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def reference_layer_norm_modulate(x: torch.Tensor, eps: float, table: torch.Tensor, emb: torch.Tensor, k_shift: int,
                                  k_scale: int, *, out_dtype: torch.dtype, mean_order: int = 0,
                                  approx_rsqrt: bool = False) -> torch.Tensor:
    """Reference of :func:`~worldfoundry.core.fusion.layer_norm.layer_norm_modulate`."""
    n = reference_layer_norm(x, eps, mean_order=mean_order, approx_rsqrt=approx_rsqrt)
    e4 = emb.unsqueeze(1) if emb.dim() == 3 else emb
    shift = table[k_shift] + e4[:, :, k_shift].float()
    scale = table[k_scale] + e4[:, :, k_scale].float()
    return (n * (1 + scale) + shift).to(out_dtype)


__all__ = ["fma32", "reference_layer_norm", "reference_layer_norm_modulate", "reference_rms_norm",
           "reference_row_stats"]
