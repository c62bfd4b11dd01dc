"""Example worldfoundry acceleration plugin: an explicit tanh-GELU for the FFNs of Wan transformers."""

from __future__ import annotations

from worldfoundry_example_gelu_tanh.kernel import gelu_tanh, gelu_tanh_reference
from worldfoundry_example_gelu_tanh.options import PLUGIN_NAME, Options

__version__ = "0.1.0"

__all__ = ["PLUGIN_NAME", "Options", "__version__", "gelu_tanh", "gelu_tanh_reference"]
