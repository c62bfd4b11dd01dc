"""The SVDQuant low-rank branch fitted to the calibration inputs, and refined against the INT4 residual's error.

SVDQuant's plain rule takes the rank-``r`` SVD of the smoothed weight ``Ŵ`` and quantizes what is left. Two
refinements use the calibration inputs' second moments ``H = X̂^T X̂`` (of the smoothed inputs, ``[K, K]``), the
same statistics GPTQ rounding uses; both change only how ``U``, ``D`` and the INT4 codes are chosen, never the
artifact format or the run-time numerics:

* **whitened fit** (``lowrank_fit="whitened"``): the rank-``r`` pair that minimises the *output* error
  ``||(Ŵ - U D) X̂^T||`` rather than the weight error ``||Ŵ - U D||``. With ``H + δI = C Cᵀ`` (Cholesky, lower),
  ``||E X̂^T||_F² = ||E C||_F²``, so it is the SVD of ``Ŵ C`` mapped back by ``C⁻¹`` (a triangular solve);
* **refinement** (``refine=n``): alternate ``n`` times between refitting the pair to what the quantized residual
  left, ``Ŵ - deq(Q)``, and requantizing the new residual ``Ŵ - U D``. Each step is the best pair given the codes
  (under the fit's norm) and GPTQ's (or nearest) rounding given the pair; the decomposition kept is the one with
  the least output error ``||(Ŵ - U D - deq(Q)) C||_F`` over all the steps, so refining never returns a worse one.

``δ`` is the dampening GPTQ uses (:data:`~worldfoundry.core.acceleration.quantization.gptq_rounding.DAMPING` of the
mean diagonal), so inputs that never varied keep a defined factor.

Example:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.randn(256, 32, generator=g) * torch.linspace(0.1, 3.0, 32)
    >>> w = torch.randn(24, 32, generator=g)
    >>> c = whitening_factor(x.t() @ x)
    >>> up, down = fit_lowrank(w, 4, whiten=c)
    >>> tuple(up.shape), tuple(down.shape)
    ((24, 4), (4, 32))
"""

from __future__ import annotations

from typing import Final

import torch

from worldfoundry.core.acceleration.quantization.gptq_rounding import DAMPING
from worldfoundry.errors import QuantizationInputError

#: How the low-rank pair is fitted: to the weight (SVDQuant's rule) or to the calibration outputs.
LOWRANK_FITS: Final = ("svd", "whitened")
#: Most refinement steps accepted (each costs one SVD and one rounding pass per Linear).
MAX_REFINE: Final = 16


def whitening_factor(moments: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor ``C`` (float64) of ``H + δI``, dead inputs' diagonal set to 1 first."""
    if moments.dim() != 2 or moments.shape[0] != moments.shape[1]:
        raise QuantizationInputError(f"whitening_factor: expected square input moments, got {tuple(moments.shape)}")
    h = moments.double().clone()
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    h += DAMPING * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return torch.linalg.cholesky(h)


def fit_lowrank(target: torch.Tensor, rank: int, *, whiten: torch.Tensor | None = None, svd: str = "full",
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U [N, r], D [r, K])`` float32 with ``U D`` the best rank-``r`` approximation of ``target``: in the
    Frobenius norm, or with ``whiten = C`` in ``||(target - U D) C||_F``. ``U = u √s``, ``D = √s vᵀ`` (``C⁻¹``)."""
    from worldfoundry.core.acceleration.quantization.svdquant_numerics import svd_top

    if whiten is None:
        u, s, vh = svd_top(target.float(), rank, svd, seed)
        root = s.clamp_min(0).sqrt()
        return u * root, root[:, None] * vh
    c = whiten.to(target.device)
    u, s, vh = svd_top((target.double() @ c).float(), rank, svd, seed)
    root = s.clamp_min(0).sqrt().double()
    # D = √s vᵀ C⁻¹  <=>  Cᵀ Dᵀ = (√s vᵀ)ᵀ
    down_t = torch.linalg.solve_triangular(c.t(), (root[:, None] * vh.double()).t(), upper=True)
    return (u.double() * root).float(), down_t.t().float()


def output_error(error: torch.Tensor, whiten: torch.Tensor | None) -> float:
    """``||error C||_F`` (``||error||_F`` without ``C``), float64."""
    e = error.double()
    return float((e if whiten is None else e @ whiten.to(e.device)).norm())


def check_fit(lowrank_fit: str, refine: int, has_moments: bool, rank: int) -> None:
    """A typed error for a fit the decomposition cannot run."""
    if lowrank_fit not in LOWRANK_FITS:
        raise QuantizationInputError(f"decompose: lowrank_fit must be one of {list(LOWRANK_FITS)}, got {lowrank_fit!r}")
    if isinstance(refine, bool) or not isinstance(refine, int) or not 0 <= refine <= MAX_REFINE:
        raise QuantizationInputError(f"decompose: refine must be an integer in [0, {MAX_REFINE}], got {refine!r}")
    if (lowrank_fit == "whitened" or refine) and not has_moments:
        raise QuantizationInputError("decompose: a whitened fit or refinement needs the calibration inputs' second "
                                     "moments (hessian)")
    if refine and rank == 0:
        raise QuantizationInputError("decompose: refinement needs a low-rank branch (rank > 0)")


__all__ = ["LOWRANK_FITS", "MAX_REFINE", "check_fit", "fit_lowrank", "output_error", "whitening_factor"]
