"""Quality metrics against the dense reference: latent relative L2, decoded-RGB PSNR, per-frame SSIM."""

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


def psnr(candidate: np.ndarray, reference: np.ndarray, data_range: float = 255.0) -> float:
    """PSNR in dB over all pixels of uint8 frames; ``inf`` when identical."""
    mse = float(np.mean((candidate.astype(np.float64) - reference.astype(np.float64)) ** 2))
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(data_range**2 / mse)


def frame_ssim(candidate: np.ndarray, reference: np.ndarray) -> list[float]:
    """SSIM of each ``(H, W, 3)`` uint8 frame (scikit-image, colour channels averaged)."""
    if candidate.shape != reference.shape:
        raise ValueError(f"frame shapes differ: {candidate.shape} vs {reference.shape}")
    out = []
    for cand, ref in zip(candidate, reference):
        win = min(7, ref.shape[0], ref.shape[1])
        win = win if win % 2 == 1 else win - 1
        out.append(float(structural_similarity(cand, ref, channel_axis=-1, data_range=255, win_size=win)))
    return out


def quality(cand_latents: torch.Tensor, ref_latents: torch.Tensor, cand_frames: np.ndarray | None,
            ref_frames: np.ndarray | None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "latent_rel_l2": relative_l2(cand_latents, ref_latents),
        "bitwise_equal": bool(cand_latents.shape == ref_latents.shape and torch.equal(cand_latents.cpu(), ref_latents.cpu())),
        "finite": bool(torch.isfinite(cand_latents).all()),
    }
    if cand_frames is not None and ref_frames is not None:
        ssims = frame_ssim(cand_frames, ref_frames)
        result.update(psnr_db=psnr(cand_frames, ref_frames), ssim_per_frame=ssims, min_ssim=min(ssims),
                      mean_ssim=float(np.mean(ssims)))
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
