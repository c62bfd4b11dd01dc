"""Error-compensating rounding of an INT4 weight (GPTQ's column order) from calibration input statistics.

Round-to-nearest treats every weight on its own. With the inputs' second moments ``H = X^T X`` (``[K, K]``, summed
over the calibration rows), the rounding error of input column ``k`` can be compensated in the columns not yet
rounded, so that the *output* ``X W^T`` moves less: columns are rounded left to right, and after each the
remaining columns absorb ``err_k * U[k, k+1:] / U[k, k]`` with ``U`` the upper Cholesky factor of ``H^-1``
(Frantar et al., "GPTQ", 2022). The codes and scales have the same format as
:func:`~worldfoundry.core.acceleration.quantization.int4_packing.quantize_int4_groupwise` (signed 4-bit codes, one
bfloat16 scale per group of ``G`` input features and output feature, ``absmax / 7`` of the group's weights at the
time the group is reached), so an artifact's consumers need nothing new.

``ordered=True`` (``--rounding gptq-ordered``) rounds the columns in decreasing order of ``H``'s diagonal instead
(GPTQ's "act order"), with every scale fixed before rounding: per output feature and group the fraction of
``absmax / 7`` (1.0 down to 0.6) whose round-to-nearest error, weighted by the inputs' mean squares, is least. Fixed
scales keep the format's contiguous groups under any column order.

In SVDQuant the quantized tensor is the residual of the smoothed weight, whose inputs are the smoothed
activations ``X / s``; :func:`smoothed_hessian` rescales ``H`` accordingly.

Example:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.randn(256, 64, generator=g) @ torch.randn(64, 64, generator=g)
    >>> w = torch.randn(16, 64, generator=g)
    >>> packed, scales = gptq_quantize_int4(w, x.t() @ x, group_size=64)
    >>> tuple(packed.shape), tuple(scales.shape)
    ((16, 32), (1, 16))
"""

from __future__ import annotations

import torch

from worldfoundry.core.acceleration.quantization.int4_packing import (
    INT4_MAX,
    INT4_MIN,
    groupwise_scales,
    pack_int4,
    scale_groups,
)
from worldfoundry.errors import QuantizationInputError

#: Columns per block of the update (within a block column by column, then one product for the columns after it).
BLOCK = 128
#: Dampening added to ``H``'s diagonal, as a fraction of its mean (keeps the Cholesky factorisation defined where
#: some inputs never varied).
DAMPING = 0.01
#: Fractions of ``absmax / 7`` the ordered rounding's scale search tries (1.0 first), 1.0 down to 0.6.
SCALE_SHRINK = tuple(1.0 - 0.025 * i for i in range(17))


def smoothed_hessian(hessian: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """``H`` of the smoothed inputs ``X / s``: ``H[i, j] / (s[i] s[j])``."""
    inv = 1.0 / smooth.float()
    return hessian.float() * inv[:, None] * inv[None, :]


def _inverse_cholesky(hessian: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damping)^-1`` (float64), with dead inputs' diagonal set to 1."""
    h = hessian.double().clone()
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    damp = DAMPING * torch.diagonal(h).mean()
    h += damp * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    lower = torch.linalg.cholesky(h)
    return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)


def searched_scales(weight: torch.Tensor, importance: torch.Tensor, group_size: int) -> torch.Tensor:
    """Scales ``[K/G or 1, N]`` (bfloat16) chosen per output feature and group from ``c * absmax / 7``,
    ``c`` in :data:`SCALE_SHRINK`: the one whose round-to-nearest error ``sum_k importance_k (w_k - q_k s)^2`` is
    least (``importance``: the inputs' mean squares, ``[K]``). ``c = 1`` is tried first, so a group's error is
    never above that of the absmax scale."""
    n, k = weight.shape
    groups = scale_groups(k, group_size)
    w = weight.detach().float().reshape(n, groups, k // groups)
    d = importance.detach().float().clamp_min(0).reshape(1, groups, k // groups)
    amax = w.abs().amax(dim=2)
    best_err = best_scale = None
    for shrink in SCALE_SHRINK:
        scale = torch.where(amax > 0, shrink * amax / INT4_MAX, torch.ones_like(amax)).to(torch.bfloat16).float()
        q = torch.round(w / scale[..., None]).clamp_(INT4_MIN, INT4_MAX)
        err = ((w - q * scale[..., None]).square() * d).sum(dim=2)
        if best_err is None:
            best_err, best_scale = err, scale
        else:
            better = err < best_err
            best_err, best_scale = torch.where(better, err, best_err), torch.where(better, scale, best_scale)
    return best_scale.t().contiguous().to(torch.bfloat16)  # type: ignore[union-attr]


def gptq_quantize_int4(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, *,
                       ordered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 codes and scales of ``weight`` ``[N, K]`` with GPTQ's error compensation under ``hessian`` ``[K, K]``.

    Args:
        weight: ``[N, K]`` float weight.
        hessian: the inputs' second moments ``X^T X`` ``[K, K]``.
        group_size: 64, 128 or 0 (per output channel).
        ordered: round the columns in decreasing order of ``H``'s diagonal (the inputs that move the output most
            first, while the most columns remain to absorb their error), with scales fixed before rounding by
            :func:`searched_scales`. ``False``: left to right, each group's scale ``absmax / 7`` of its weights
            as they are when the group is reached.

    Returns:
        ``(packed int8 [N, K/2], scales bfloat16 [K/G or 1, N])``, the format of ``quantize_int4_groupwise``.

    Raises:
        QuantizationInputError: shapes that do not match, or a group size the format does not take.
    """
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise QuantizationInputError(f"gptq_quantize_int4: weight {tuple(weight.shape)} and input statistics "
                                     f"{tuple(hessian.shape)} do not match ([N, K] and [K, K])")
    n, k = weight.shape
    groupwise_scales(weight, group_size)  # the format's checks of the group size
    groups = scale_groups(k, group_size)
    hessian = hessian.to(weight.device)
    if not ordered:
        order = torch.arange(k, device=weight.device)
        scales = torch.empty((groups, n), dtype=torch.bfloat16, device=weight.device)
    else:
        order = torch.argsort(torch.diagonal(hessian).float(), descending=True, stable=True)
        scales = searched_scales(weight, torch.diagonal(hessian), group_size)
    codes = _compensated_codes(weight.detach().double()[:, order], _inverse_cholesky(hessian[order][:, order]),
                               scales, order, k // groups, dynamic=not ordered)
    return pack_int4(codes, group_size), scales


def _compensated_codes(w: torch.Tensor, u: torch.Tensor, scales: torch.Tensor, order: torch.Tensor, width: int, *,
                       dynamic: bool) -> torch.Tensor:
    """Codes ``[N, K]`` (original column order) of ``w`` (columns in ``order``), rounded column by column with
    the error pushed into the later columns through ``u``. ``dynamic``: a group's scale is set (in ``scales``)
    from its weights when its first column is reached (``order`` is then the identity)."""
    n, k = w.shape
    codes = torch.empty((n, k), dtype=torch.int8, device=w.device)
    columns = order.tolist()
    group_of = [c // width for c in columns]
    for b0 in range(0, k, BLOCK):  # columns in blocks; the errors of a block reach the later blocks at its end
        b1 = min(b0 + BLOCK, k)
        block = w[:, b0:b1]
        err = torch.empty_like(block)
        for i in range(b1 - b0):
            pos = b0 + i
            if dynamic and pos % width == 0:  # a group starts: its scale from its weights as they are now
                amax = block[:, i:i + width].float().abs().amax(dim=1) if width <= b1 - pos else \
                    w[:, pos:pos + width].float().abs().amax(dim=1)
                scales[pos // width] = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax)).to(torch.bfloat16)
            scale = scales[group_of[pos]].double()
            q = torch.round(block[:, i] / scale).clamp_(INT4_MIN, INT4_MAX)
            codes[:, columns[pos]] = q.to(torch.int8)
            err[:, i] = (block[:, i] - q * scale) / u[pos, pos]
            block[:, i + 1:] -= err[:, i:i + 1] * u[pos, pos + 1:b1][None, :]
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return codes


__all__ = ["BLOCK", "DAMPING", "SCALE_SHRINK", "gptq_quantize_int4", "searched_scales", "smoothed_hessian"]
