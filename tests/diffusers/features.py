"""diffusers features a user applies next to the accelerations, and a Wan attention adapter file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pipelines import WAN


def lora_state_dict(seed: int = 3, rank: int = 2, magnitude: float = 0.5) -> dict[str, torch.Tensor]:
    """A diffusers-format LoRA on every attention projection of the tiny Wan (``load_lora_weights``)."""
    g = torch.Generator().manual_seed(seed)
    inner = WAN["num_attention_heads"] * WAN["attention_head_dim"]
    out: dict[str, torch.Tensor] = {}
    for i in range(WAN["num_layers"]):
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                key = f"transformer.blocks.{i}.{attn}.{proj}"
                out[f"{key}.lora_A.weight"] = torch.randn(rank, inner, generator=g) * magnitude
                out[f"{key}.lora_B.weight"] = torch.randn(inner, rank, generator=g) * magnitude
    return out


def write_attention_adapter(directory: Path, rank: int = 2, seed: int = 9) -> dict[str, Any]:
    """An ``attention_lora`` adapter file for the tiny Wan; returns its spec options."""
    from safetensors.torch import save_file

    state = {k.removeprefix("transformer."): v for k, v in lora_state_dict(seed, rank, 0.3).items()}
    path = directory / "attention-adapter.safetensors"
    save_file(state, str(path))
    return {"path": str(path), "rank": rank, "scale": 0.5}


def _first_block_cache(pipe: Any) -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.05))


#: name -> how a user applies it to a pipeline.
FEATURES: dict[str, Callable[[Any], Any]] = {
    "load_lora_weights": lambda p: p.load_lora_weights(lora_state_dict(), adapter_name="user"),
    "fuse_lora": lambda p: (p.load_lora_weights(lora_state_dict(), adapter_name="user"), p.fuse_lora()),
    "enable_cache": _first_block_cache,
    "fuse_qkv_projections": lambda p: p.transformer.fuse_qkv_projections(),
    "set_attention_backend": lambda p: p.transformer.set_attention_backend("native"),
    "enable_layerwise_casting": lambda p: p.transformer.enable_layerwise_casting(
        storage_dtype=torch.bfloat16, compute_dtype=torch.float32),
    "enable_group_offload": lambda p: p.transformer.enable_group_offload(torch.device("cpu"),
                                                                          offload_type="leaf_level"),
}
