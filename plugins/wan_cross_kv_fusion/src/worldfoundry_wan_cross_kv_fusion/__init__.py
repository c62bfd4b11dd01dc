"""``wan_cross_kv_fusion``: packed Wan cross-attention K/V projections and per-request static text (and image)
K/V, bitwise equal to the dense model."""

from __future__ import annotations

from worldfoundry_wan_cross_kv_fusion.options import PLUGIN_NAME, Options

__version__ = "0.1.0"

__all__ = ["PLUGIN_NAME", "Options", "__version__"]
