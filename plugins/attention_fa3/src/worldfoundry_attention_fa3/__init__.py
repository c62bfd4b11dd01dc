"""The ``fa3`` attention provider (FlashAttention-3 forward from the ``fa3-fwd`` wheel) for ``attention_policy``."""

from __future__ import annotations

from worldfoundry_attention_fa3.provider import NAME, fa3_provider

__version__ = "0.1.0"

__all__ = ["NAME", "__version__", "fa3_provider"]
