"""``VaeLatentCodec``: the pipeline's view of a Wan-family VAE (normalised latents in, [-1, 1] video out)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


class VaeLatentCodec:
    """Wraps a diffusers ``AutoencoderKLWan``: ``encode`` returns latents normalised with the VAE's
    ``latents_mean``/``latents_std`` (as Wan pipelines feed the DiT); ``decode`` inverts that and returns a
    BCTHW video in [-1, 1]. Each call starts from a cleared causal cache (diffusers clears it per call)."""

    def __init__(self, module: nn.Module, *, tiled: bool = False, variant: str = "wan2.1",
                 report: dict[str, Any] | None = None) -> None:
        self.module = module
        self.variant = variant
        self.tiled = bool(tiled)
        self.report = dict(report or {})
        if self.tiled and hasattr(module, "enable_tiling"):
            module.enable_tiling()
        cfg = module.config
        self.temporal_stride = int(getattr(cfg, "scale_factor_temporal", 4))
        self.spatial_stride = int(getattr(cfg, "scale_factor_spatial", 8))
        self.z_dim = int(cfg.z_dim)
        self.calls = {"encode": 0, "decode": 0}

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and reciprocal std, computed as diffusers' Wan pipelines do (so latents match them bitwise)."""
        cfg = self.module.config
        mean = torch.tensor(cfg.latents_mean).view(1, self.z_dim, 1, 1, 1).to(like.device, like.dtype)
        inv_std = (1.0 / torch.tensor(cfg.latents_std).view(1, self.z_dim, 1, 1, 1)).to(like.device, like.dtype)
        return mean, inv_std

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """BCTHW video in [-1, 1] -> normalised latents (distribution mode)."""
        with torch.no_grad():
            latents = self.module.encode(video.to(self.device, self.dtype)).latent_dist.mode()
        mean, inv_std = self._stats(latents)
        self.calls["encode"] += 1
        return (latents - mean) * inv_std

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> BCTHW video in [-1, 1] (float32)."""
        latents = latents.to(self.device, self.dtype)
        mean, inv_std = self._stats(latents)
        with torch.no_grad():
            video = self.module.decode(latents / inv_std + mean, return_dict=False)[0]
        self.calls["decode"] += 1
        return video.float().clamp(-1.0, 1.0)

    def execution_report(self) -> dict[str, Any]:
        return {"variant": self.variant, "tiled": self.tiled, "calls": dict(self.calls), **self.report}


def video_to_uint8(video: torch.Tensor) -> Any:
    """BCTHW [-1, 1] -> ``(F, H, W, 3)`` uint8 numpy frames of the first batch item."""
    frames = ((video[0].permute(1, 2, 3, 0).float().clamp(-1, 1) + 1.0) * 127.5).round()
    return frames.to(torch.uint8).cpu().numpy()
