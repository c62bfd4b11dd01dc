"""Quality metrics against the dense reference: latent relative L2, decoded-RGB PSNR, per-frame SSIM.

SSIM is scikit-image's ``structural_similarity`` (7 x 7 uniform window, sample covariance, ``K1 = 0.01``,
``K2 = 0.03``, colour channels averaged). Frames equal to their reference get 1.0 without computing it (what
scikit-image returns for them, exactly). With ``device`` a CUDA device, PSNR and SSIM run there in float64 torch:
the same statistics over the same window, within 1e-9 of scikit-image (tested), in milliseconds instead of about
a second per 17-frame 320 x 576 clip on the host, which the bench's runs on a GPU would otherwise spend per
candidate. On the CPU scikit-image computes them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from skimage.metrics import structural_similarity


def relative_l2(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """``||candidate - reference|| / ||reference||`` in float64."""
    ref = reference.detach().double().cpu()
    diff = candidate.detach().double().cpu() - ref
    denom = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(diff))
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom


def psnr(candidate: np.ndarray, reference: np.ndarray, data_range: float = 255.0, *,
         device: torch.device | str | None = None) -> float:
    """PSNR in dB over all pixels of uint8 frames; ``inf`` when identical (float64; on ``device`` when CUDA)."""
    if candidate.shape == reference.shape and np.array_equal(candidate, reference):
        return math.inf
    if _on_cuda(device):
        diff = _float64(candidate, device) - _float64(reference, device)
        mse = float(diff.square().mean())
    else:
        mse = float(np.mean((candidate.astype(np.float64) - reference.astype(np.float64)) ** 2))
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(data_range**2 / mse)


def frame_ssim(candidate: np.ndarray, reference: np.ndarray, *,
               device: torch.device | str | None = None) -> list[float]:
    """SSIM of each ``(H, W, 3)`` uint8 frame (scikit-image's, colour channels averaged; 1.0 for an identical
    frame; on ``device`` in float64 torch when it is a CUDA device)."""
    if candidate.shape != reference.shape:
        raise ValueError(f"frame shapes differ: {candidate.shape} vs {reference.shape}")
    out = []
    for cand, ref in zip(candidate, reference):
        win = min(7, ref.shape[0], ref.shape[1])
        win = win if win % 2 == 1 else win - 1
        if np.array_equal(cand, ref):
            out.append(1.0)
        elif _on_cuda(device):
            out.append(ssim_torch(cand, ref, win, device))  # type: ignore[arg-type]
        else:
            out.append(float(structural_similarity(cand, ref, channel_axis=-1, data_range=255, win_size=win)))
    return out


def ssim_torch(candidate: np.ndarray, reference: np.ndarray, win: int = 7,
               device: torch.device | str = "cpu") -> float:
    """scikit-image's SSIM of one ``(H, W, C)`` uint8 frame pair (``data_range`` 255), in float64 torch on
    ``device``: means, variances and covariance over ``win x win`` windows (sample covariance), the SSIM map
    over the windows that fit inside the frame (scikit-image crops the same border), averaged per channel,
    then over channels."""
    x = _float64(candidate, device).permute(2, 0, 1).unsqueeze(1)  # [C, 1, H, W]
    y = _float64(reference, device).permute(2, 0, 1).unsqueeze(1)

    def mean(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(t, win, stride=1)

    cov_norm = win * win / (win * win - 1.0)
    ux, uy = mean(x), mean(y)
    vx = cov_norm * (mean(x * x) - ux * ux)
    vy = cov_norm * (mean(y * y) - uy * uy)
    vxy = cov_norm * (mean(x * y) - ux * uy)
    c1, c2 = (0.01 * 255.0) ** 2, (0.03 * 255.0) ** 2
    s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux * ux + uy * uy + c1) * (vx + vy + c2))
    return float(s.mean(dim=(1, 2, 3)).mean())


def _on_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _float64(frames: np.ndarray, device: torch.device | str | None) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(frames)).to(device).double()


def quality(cand_latents: torch.Tensor, ref_latents: torch.Tensor, cand_frames: np.ndarray | None,
            ref_frames: np.ndarray | None) -> dict[str, Any]:
    """Latent error and, with frames, PSNR and per-frame SSIM (computed on the latents' device when CUDA)."""
    result: dict[str, Any] = {
        "latent_rel_l2": relative_l2(cand_latents, ref_latents),
        "bitwise_equal": bool(cand_latents.shape == ref_latents.shape
                              and torch.equal(cand_latents, ref_latents.to(cand_latents.device))),
        "finite": bool(torch.isfinite(cand_latents).all()),
    }
    if cand_frames is not None and ref_frames is not None:
        device = cand_latents.device
        ssims = frame_ssim(cand_frames, ref_frames, device=device)
        result.update(psnr_db=psnr(cand_frames, ref_frames, device=device), ssim_per_frame=ssims,
                      min_ssim=min(ssims), mean_ssim=float(np.mean(ssims)))
    return result


def within_budget(q: dict[str, Any], budget: dict[str, float]) -> dict[str, bool]:
    checks = {"latent_rel_l2": q["latent_rel_l2"] <= budget["latent_rel_l2"]}
    if "psnr_db" in q:
        checks["psnr_db"] = q["psnr_db"] >= budget["psnr_db"]
        checks["min_ssim"] = q["min_ssim"] >= budget["min_ssim"]
    return checks


def json_number(value: float) -> float | str:
    """JSON has no infinity: ``inf`` becomes the string ``"inf"``."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value
