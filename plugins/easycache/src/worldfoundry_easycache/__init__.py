"""EasyCache for worldfoundry: reuse the model's input -> output transformation on stable denoising steps."""

from __future__ import annotations

from worldfoundry_easycache.options import PLUGIN_NAME, Options

__all__ = ["PLUGIN_NAME", "Options"]
