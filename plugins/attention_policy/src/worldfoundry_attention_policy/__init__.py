"""``attention_policy``: per attention type (self, text cross, image cross) an attention provider — PyTorch SDPA
backends, FlashAttention-3, SageAttention or any registered third-party kernel — with ``min_tokens``, dense
first/last steps and per-call receipts."""

from __future__ import annotations

from worldfoundry_attention_policy.options import PLUGIN_NAME, Options, TypePolicy

__version__ = "0.1.0"

__all__ = ["PLUGIN_NAME", "Options", "TypePolicy", "__version__"]
