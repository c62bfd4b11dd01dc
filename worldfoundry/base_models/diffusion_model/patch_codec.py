"""``PixelPatchCodec``: a fixed, exactly invertible pixel-space latent (space-to-depth patches).

Used by the small trained model shipped with the project: with no learned codec in the way, every
difference a benchmark measures in decoded RGB comes from the DiT and the accelerations. A BCTHW video in
[-1, 1] becomes latents of shape ``(B, 3·p·p, T, H/p, W/p)`` scaled by ``scale``; decoding inverts it exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


class PixelPatchCodec(nn.Module):
    """No weights; ``patch`` is the spatial patch size, ``scale`` multiplies pixel values into latents."""

    def __init__(self, patch: int = 4, scale: float = 2.0) -> None:
        super().__init__()
        if patch < 1:
            raise ValueError(f"patch must be >= 1, got {patch}")
        self.patch = int(patch)
        self.scale = float(scale)
        self.config = {"patch": self.patch, "scale": self.scale}
        self.temporal_stride = 1
        self.spatial_stride = self.patch
        self.z_dim = 3 * self.patch * self.patch
        self.variant = "pixel_patch"
        self.tiled = False
        self.calls = {"encode": 0, "decode": 0}
        self.register_buffer("_device_anchor", torch.zeros(()), persistent=False)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PixelPatchCodec:
        return cls(**dict(config))

    @staticmethod
    def strides_for(config: dict[str, Any]) -> tuple[int, int]:
        """``(temporal, spatial)`` stride of the codec a config builds, without building it."""
        return 1, int(config.get("patch", 4))

    @property
    def module(self) -> PixelPatchCodec:
        return self

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self._device_anchor.device

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """BCTHW video in [-1, 1] -> (B, 3·p·p, T, H/p, W/p) latents."""
        b, c, t, h, w = video.shape
        p = self.patch
        if c != 3 or h % p or w % p:
            raise ValueError(f"video must be Bx3xTxHxW with H, W divisible by {p}, got {tuple(video.shape)}")
        x = video.float().reshape(b, 3, t, h // p, p, w // p, p)
        x = x.permute(0, 1, 4, 6, 2, 3, 5).reshape(b, 3 * p * p, t, h // p, w // p)
        self.calls["encode"] += 1
        return x * self.scale

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`encode`; returns float32 BCTHW in [-1, 1]."""
        b, c, t, hp, wp = latents.shape
        p = self.patch
        if c != self.z_dim:
            raise ValueError(f"latents must have {self.z_dim} channels, got {c}")
        x = (latents.float() / self.scale).reshape(b, 3, p, p, t, hp, wp)
        x = x.permute(0, 1, 4, 5, 2, 6, 3).reshape(b, 3, t, hp * p, wp * p)
        self.calls["decode"] += 1
        return x.clamp(-1.0, 1.0)

    def execution_report(self) -> dict[str, Any]:
        return {"variant": self.variant, "tiled": False, "calls": dict(self.calls), "exactly_invertible": True}
