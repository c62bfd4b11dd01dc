"""The ``sage`` attention provider (SageAttention 1.0, approximate) for ``attention_policy``."""

from __future__ import annotations

from worldfoundry_attention_sage.provider import NAME, sage_provider

__version__ = "0.1.0"

__all__ = ["NAME", "__version__", "sage_provider"]
