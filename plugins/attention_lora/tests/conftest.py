"""Tiny MiniMax-H3 / Wan transformers, fixed inputs and adapters written in the documented layouts.

Adapters are built here from first principles (not with the code under test): the H3 fused QKV ``lora_B`` is
assembled per head as ``[head0: q k v, head1: q k v, ...]`` from separately drawn Q/K/V blocks, so the tests
know the exact ``to_q``/``to_k``/``to_v`` matrices the plugin must apply.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn as nn

from worldfoundry import testing

TINY_H3_CONFIG: dict[str, Any] = dict(testing.MINIMAX_H3_TINY)
TINY_WAN_CONFIG: dict[str, Any] = dict(testing.WAN_TINY)
H3_CONFIG, WAN_CONFIG = TINY_H3_CONFIG, TINY_WAN_CONFIG


def build_h3(seed: int = 0, **overrides: Any) -> nn.Module:
    return testing.tiny_minimax_h3(seed, weight_scale=0.1, weight_seed=seed, **overrides)


def build_wan(seed: int = 0, **overrides: Any) -> nn.Module:
    return testing.tiny_wan(seed, weight_scale=0.1, weight_seed=seed, **overrides)


def h3_inputs(model: nn.Module, seed: int = 1, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A packed sequence: 3 text rows, 8 video rows (2 frames of 2×2 patches), 2 audio rows."""
    return testing.minimax_h3_inputs(model, seed, dtype=dtype)


def wan_inputs(seed: int = 1, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return testing.wan_inputs(seed=seed, dtype=dtype)


run = testing.run_model


@dataclass
class H3Adapter:
    """An H3 attention state and, per adapted module path, the (A, B) the plugin must apply."""

    state: dict[str, torch.Tensor]
    expected: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def make_h3_adapter(model: nn.Module, rank: int = 4, seed: int = 0, *, prefix: str = "", infix: str = "",
                    magnitude: float = 0.2, only: str | None = None) -> H3Adapter:
    """The complete H3 attention state in the original naming (QKV ``lora_B`` interleaved per head).

    Args:
        only: ``"q"``, ``"k"`` or ``"v"`` keeps only those rows of every QKV ``lora_B`` nonzero.
    """
    cfg = model.config
    heads, head_dim, hidden = cfg.num_attention_heads, cfg.attention_head_dim, cfg.hidden_size
    inner = heads * head_dim
    g = torch.Generator().manual_seed(seed)
    adapter = H3Adapter({})
    blocks = [("blocks", "transformer_blocks", cfg.num_layers),
              ("token_refiner.blocks", "token_refiner.refiner_blocks", cfg.num_refiner_layers)]
    for source, target, count in blocks:
        for i in range(count):
            a_qkv = torch.randn(rank, hidden, generator=g) * magnitude
            parts = {n: torch.randn(inner, rank, generator=g) * magnitude for n in "qkv"}
            if only is not None:
                parts = {n: (p if n == only else torch.zeros_like(p)) for n, p in parts.items()}
            per_head = [torch.cat([parts[n][h * head_dim:(h + 1) * head_dim] for n in "qkv"]) for h in range(heads)]
            b_qkv = torch.cat(per_head)
            a_out = torch.randn(rank, inner, generator=g) * magnitude
            b_out = torch.randn(hidden, rank, generator=g) * magnitude
            base = f"{prefix}{source}.{i}.attn"
            adapter.state[f"{base}.qkv_proj.lora_A{infix}.weight"] = a_qkv
            adapter.state[f"{base}.qkv_proj.lora_B{infix}.weight"] = b_qkv
            adapter.state[f"{base}.out_proj.lora_A{infix}.weight"] = a_out
            adapter.state[f"{base}.out_proj.lora_B{infix}.weight"] = b_out
            if source == "blocks":
                for n in "qkv":
                    adapter.expected[f"{target}.{i}.attn.to_{n}"] = (a_qkv, parts[n])
                adapter.expected[f"{target}.{i}.attn.to_out.0"] = (a_out, b_out)
    return adapter


def make_wan_adapter(model: nn.Module, rank: int = 4, seed: int = 0, *, prefix: str = "", infix: str = "",
                     magnitude: float = 0.2,
                     projections: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0"),
                     attentions: tuple[str, ...] = ("attn1", "attn2")) -> H3Adapter:
    g = torch.Generator().manual_seed(seed)
    adapter = H3Adapter({})
    for i in range(len(model.blocks)):
        for attn in attentions:
            for proj in projections:
                module = model.get_submodule(f"blocks.{i}.{attn}.{proj}")
                a = torch.randn(rank, module.in_features, generator=g) * magnitude
                b = torch.randn(module.out_features, rank, generator=g) * magnitude
                adapter.state[f"{prefix}blocks.{i}.{attn}.{proj}.lora_A{infix}.weight"] = a
                adapter.state[f"{prefix}blocks.{i}.{attn}.{proj}.lora_B{infix}.weight"] = b
                adapter.expected[f"blocks.{i}.{attn}.{proj}"] = (a, b)
    return adapter


class ProjectionRecorder:
    """Forward hooks (outside the patched forward) that record every adapted projection's input and output."""

    def __init__(self, model: nn.Module, paths: list[str]) -> None:
        self.calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {p: [] for p in paths}
        self._handles = [
            model.get_submodule(p).register_forward_hook(
                lambda mod, args, out, p=p: self.calls[p].append((args[0].detach().clone(), out.detach().clone())))
            for p in paths
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def state_snapshot(model: nn.Module) -> testing.ModelFingerprint:
    """Independent restore check (:func:`worldfoundry.testing.fingerprint`, no forward) of the guarded model.

    The request guard the installer attaches stays by design (it belongs to the loader, not to a plugin).
    """
    return testing.fingerprint(testing.guarded(model), forward=False)


assert_snapshot_equal = testing.assert_same_model


@pytest.fixture
def h3() -> nn.Module:
    return build_h3()


@pytest.fixture
def wan() -> nn.Module:
    return build_wan()


@pytest.fixture
def tools() -> ModuleType:
    """The helpers above, for tests (pytest's importlib mode does not import conftest as a module)."""
    return sys.modules[__name__]
