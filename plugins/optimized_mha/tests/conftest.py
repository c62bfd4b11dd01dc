"""Tiny diffusers models of every supported family, their inputs, and a fresh registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
from worldfoundry_optimized_mha.plugin import prepare

from worldfoundry import testing
from worldfoundry.core.acceleration.registry import AccelerationRegistry


@dataclass
class TinyCase:
    """A model, a function building its inputs, and the attention paths it has."""

    name: str
    model: nn.Module
    make_inputs: Callable[[int], dict[str, Any]]
    self_paths: tuple[str, ...]
    cross_paths: tuple[str, ...]

    def run(self, seed: int = 0) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(**self.make_inputs(seed), return_dict=False)
        return torch.cat([o.flatten() for o in out]) if isinstance(out, tuple) else out


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tiny_wan(image: bool = False) -> TinyCase:
    extra = {"image_dim": 32, "added_kv_proj_dim": 64} if image else {}
    model = testing.tiny_wan(0, weight_scale=None, **extra)

    def inputs(seed: int) -> dict[str, Any]:
        g = _gen(seed)
        kwargs = {"hidden_states": torch.randn(1, 16, 2, 8, 8, generator=g), "timestep": torch.tensor([500]),
                  "encoder_hidden_states": torch.randn(1, 512 if image else 24, 32, generator=g)}
        if image:
            kwargs["encoder_hidden_states_image"] = torch.randn(1, 4, 32, generator=g)
        return kwargs

    blocks = ("blocks.0", "blocks.1")
    return TinyCase("wan-i2v" if image else "wan", model, inputs, tuple(f"{b}.attn1" for b in blocks),
                    tuple(f"{b}.attn2" for b in blocks))


def tiny_sana() -> TinyCase:
    model = testing.tiny_sana_video(0, patch_size=(1, 2, 2), rope_max_seq_len=64)

    def inputs(seed: int) -> dict[str, Any]:
        g = _gen(seed)
        mask = torch.ones(1, 12)
        mask[:, 9:] = 0
        return {"hidden_states": torch.randn(1, 16, 2, 8, 8, generator=g),
                "encoder_hidden_states": torch.randn(1, 12, 32, generator=g), "timestep": torch.tensor([500]),
                "encoder_attention_mask": mask}

    blocks = ("transformer_blocks.0", "transformer_blocks.1")
    return TinyCase("sana", model, inputs, tuple(f"{b}.attn1" for b in blocks), tuple(f"{b}.attn2" for b in blocks))


def tiny_h3() -> TinyCase:
    from worldfoundry.base_models.diffusion_model.h3_session import build_random_h3_bundle

    config = dict(testing.MINIMAX_H3_TINY)
    model = testing.tiny_minimax_h3(0)

    def inputs(seed: int) -> dict[str, Any]:
        b = build_random_h3_bundle(config, seed=seed)
        return {"hidden_states": b["video_latents"], "audio_hidden_states": b["audio_latents"],
                "encoder_hidden_states": b["text_embeds"], "timestep": torch.tensor([0.5, 0.0]),
                "timestep_indices": b["row_is_clean"], "token_tags": b["token_tags"],
                "position_ids": b["position_ids"], "video_indices": b["video_indices"],
                "audio_indices": b["audio_indices"], "text_indices": b["text_indices"]}

    return TinyCase("h3", model, inputs, ("transformer_blocks.0.attn", "transformer_blocks.1.attn"), ())


BUILDERS: dict[str, Callable[[], TinyCase]] = {
    "wan": tiny_wan, "wan-i2v": lambda: tiny_wan(image=True), "sana": tiny_sana, "h3": tiny_h3,
}


@pytest.fixture(params=sorted(BUILDERS))
def case(request: pytest.FixtureRequest) -> TinyCase:
    return BUILDERS[request.param]()


@pytest.fixture
def wan_case() -> TinyCase:
    return tiny_wan()


@pytest.fixture
def registry() -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("optimized_mha", prepare)
    return reg



@pytest.fixture
def builders() -> dict[str, Callable[[], TinyCase]]:
    """Builders of fresh tiny cases (same seeds, so the same initial weights)."""
    return BUILDERS
