"""Selective FP8 for worldfoundry: rowwise FP8 ``torch._scaled_mm`` on chosen Linears, fused activation quant."""

from __future__ import annotations

from worldfoundry_selective_fp8.options import PLUGIN_NAME, Options

__all__ = ["PLUGIN_NAME", "Options"]
