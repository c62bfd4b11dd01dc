"""``cuda_graph``: steady-state CUDA-graph replay of the denoiser forward, per call signature."""

from __future__ import annotations

from worldfoundry_cuda_graph.options import PLUGIN_NAME, Options

__version__ = "0.1.0"

__all__ = ["PLUGIN_NAME", "Options", "__version__"]
