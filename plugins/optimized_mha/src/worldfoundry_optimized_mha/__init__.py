"""``optimized_mha``: packed Q/K/V (self) and K/V (cross) projections without extra weight memory, and an
explicit PyTorch SDPA backend per attention kind."""

from __future__ import annotations

from worldfoundry_optimized_mha.options import PLUGIN_NAME, AttentionOptions, Options

__version__ = "0.1.0"

__all__ = ["PLUGIN_NAME", "AttentionOptions", "Options", "__version__"]
