"""``attention_lora``: a reversible DiT attention LoRA whose adapter arithmetic runs in FP32 beside each projection.

Spec: ``{"attention_lora": {"path": "attention-adapter.safetensors", "rank": 8, "scale": -1.0}}``.
See ``docs/attention_lora.md``.
"""

from __future__ import annotations

from worldfoundry_attention_lora.context import (
    apply_dit_attention_lora,
    resolve_transformers,
)
from worldfoundry_attention_lora.options import NAME, Options
from worldfoundry_attention_lora.plugin import make_prepare, prepare_attention_lora

__all__ = ["NAME", "Options", "apply_dit_attention_lora", "make_prepare", "prepare_attention_lora", "resolve_transformers"]
