"""SVDQuant for worldfoundry: calibrated low-rank + INT4 residual Linears from a bound artifact."""

from __future__ import annotations

from worldfoundry_svdquant.options import PLUGIN_NAME, Options

__all__ = ["PLUGIN_NAME", "Options"]
