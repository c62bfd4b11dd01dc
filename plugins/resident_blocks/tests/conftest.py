"""Fixtures for the resident_blocks tests: tiny seeded Wan / MiniMax-H3 transformers, a fresh registry and
a request driver that calls the model the way the native runner does (begin, steps × CFG branches in a
request context, end in ``finally``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn
from diffusers import MiniMaxH3Transformer3DModel, WanTransformer3DModel
from worldfoundry_resident_blocks.plugin import prepare

from worldfoundry import testing
from worldfoundry.core.acceleration.registry import AccelerationRegistry

TINY_WAN = dict(
    num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
    ffn_dim=32, num_layers=4, rope_max_seq_len=32,
)
TINY_H3 = dict(
    num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=3, num_refiner_layers=1,
    ffn_dim=64, in_channels=4, audio_in_channels=4, text_dim=16, freq_dim=16, time_embed_hidden_dim=32,
    time_embed_dim=16, rope_freq_dim=2,
)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models run fastest (and steadiest on a loaded machine) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_tiny_wan(seed: int = 0, **overrides: Any) -> WanTransformer3DModel:
    """A seeded 4-block Wan transformer with non-trivial weights everywhere, in eval mode."""
    return testing.tiny_wan(seed, weight_scale=0.1, **{**TINY_WAN, **overrides}).requires_grad_(False)


def wan_inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    return testing.wan_inputs(TINY_WAN, seed, frames=2, text_tokens=6, timestep=700)


def wan_forward(model: nn.Module, inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    return testing.run_model(model, inputs or wan_inputs())


def make_tiny_h3(seed: int = 0) -> MiniMaxH3Transformer3DModel:
    return testing.tiny_minimax_h3(seed, weight_scale=0.1, **TINY_H3).requires_grad_(False)


def h3_inputs(seed: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    video, audio, text = 8, 2, 3
    seq = video + audio + text
    return {
        "hidden_states": torch.randn(1, video, 16, generator=g),
        "audio_hidden_states": torch.randn(1, audio, 4, generator=g),
        "encoder_hidden_states": torch.randn(1, text, 16, generator=g),
        "timestep": torch.tensor([0.0, 0.6]),
        "timestep_indices": torch.tensor([0] * text + [1] * (video + audio)),
        "token_tags": torch.tensor([1] * text + [0] * video + [2] * audio),
        "position_ids": torch.stack(
            [torch.arange(seq) // 4, torch.arange(seq) % 4, torch.zeros(seq, dtype=torch.long)], 1),
        "video_indices": torch.arange(text, text + video),
        "audio_indices": torch.arange(text + video, seq),
        "text_indices": torch.arange(text),
    }


def h3_forward(model: nn.Module) -> torch.Tensor:
    return testing.run_model(model, h3_inputs())


@pytest.fixture
def registry() -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("resident_blocks", prepare)
    return reg


def run_request(model: nn.Module, request_id: str, *, steps: int = 2, branches: tuple[str, ...] = ("cond", "uncond"),
                inputs: dict[str, torch.Tensor] | None = None,
                forward: Callable[..., torch.Tensor] = wan_forward) -> list[torch.Tensor]:
    """One request: ``steps`` × ``branches`` forwards inside the guard's request and a request context."""
    return testing.run_request(
        model, request_id, lambda step, branch: forward(model, inputs) if inputs is not None else forward(model),
        steps=steps, branches=branches)


@pytest.fixture
def tiny() -> SimpleNamespace:
    """The helpers above, for test modules (test files cannot import conftest under importlib mode)."""
    return SimpleNamespace(
        TINY_WAN=TINY_WAN, TINY_H3=TINY_H3, N=TINY_WAN["num_layers"], make_tiny_wan=make_tiny_wan,
        wan_inputs=wan_inputs, wan_forward=wan_forward, make_tiny_h3=make_tiny_h3, h3_inputs=h3_inputs,
        h3_forward=h3_forward, run_request=run_request,
    )
