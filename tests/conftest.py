"""Shared fixtures: a tiny seeded Wan transformer, fixed inputs and an independent model fingerprint.

The fingerprint is written here, not taken from worldfoundry, so the restore checks do not trust the code
they test: it records every module's identity and instance attributes, the contents of every parameter /
buffer / child / hook dictionary, parameter identities, the state dict values and a forward output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn

# Tiny tensors gain nothing from intra-op threads, and on a busy 2-core CI machine OpenMP synchronisation makes
# every small op many times slower. One thread keeps the suite fast and its results reproducible.
torch.set_num_threads(1)

TINY_WAN_CONFIG: dict[str, Any] = dict(
    num_attention_heads=2,
    attention_head_dim=32,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=32,
    ffn_dim=128,
    num_layers=2,
    rope_max_seq_len=64,
)


def build_tiny_wan(seed: int = 0) -> nn.Module:
    """A 2-layer, 2-head (x32) ``WanTransformer3DModel`` with seeded random weights, in eval mode."""
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**TINY_WAN_CONFIG)
        # diffusers zero-initialises some projections; give every tensor non-trivial values.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.05)
    return model.eval()


def wan_inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, 16, 1, 4, 4, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
    }


def wan_forward(model: nn.Module, inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(**(inputs or wan_inputs()), return_dict=False)[0]


_HOOK_DICTS = (
    "_parameters",
    "_buffers",
    "_modules",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_always_called",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


@dataclass
class ModelFingerprint:
    modules: list[tuple[str, int, str]]
    attrs: dict[str, dict[str, int]]
    dicts: dict[str, dict[str, list[tuple[Any, int]]]]
    non_persistent: dict[str, frozenset[str]]
    param_ids: dict[str, int]
    state: dict[str, torch.Tensor]
    output: torch.Tensor | None


def fingerprint(model: nn.Module, *, forward: bool = True) -> ModelFingerprint:
    modules, attrs, dicts, non_persistent = [], {}, {}, {}
    for name, module in model.named_modules(remove_duplicate=False):
        key = name or "<root>"
        modules.append((key, id(module), type(module).__qualname__))
        attrs[key] = {k: id(v) for k, v in module.__dict__.items() if k not in _HOOK_DICTS}
        dicts[key] = {k: [(hk, id(hv)) for hk, hv in module.__dict__[k].items()]
                      for k in _HOOK_DICTS if k in module.__dict__}
        non_persistent[key] = frozenset(module._non_persistent_buffers_set)
    return ModelFingerprint(
        modules=modules,
        attrs=attrs,
        dicts=dicts,
        non_persistent=non_persistent,
        param_ids={n: id(p) for n, p in model.named_parameters(remove_duplicate=False)},
        state={k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        output=wan_forward(model) if forward else None,
    )


def assert_same_model(before: ModelFingerprint, after: ModelFingerprint) -> None:
    """Module tree, attributes, hooks, parameter identities, state dict values and output: all identical."""
    assert after.modules == before.modules, "module tree changed"
    for key in before.attrs:
        added = sorted(set(after.attrs[key]) - set(before.attrs[key]))
        removed = sorted(set(before.attrs[key]) - set(after.attrs[key]))
        changed = sorted(k for k in before.attrs[key]
                         if k in after.attrs[key] and after.attrs[key][k] != before.attrs[key][k])
        assert not (added or removed or changed), f"{key}: attributes added {added} removed {removed} changed {changed}"
        assert after.dicts[key] == before.dicts[key], f"{key}: parameter/buffer/module/hook dictionaries changed"
        assert after.non_persistent[key] == before.non_persistent[key], f"{key}: non-persistent buffer set changed"
    assert after.param_ids == before.param_ids, "parameter identities changed"
    assert list(after.state) == list(before.state), "state dict keys changed"
    for k, v in before.state.items():
        assert after.state[k].dtype == v.dtype and torch.equal(after.state[k], v), f"state dict value {k} changed"
    if before.output is not None and after.output is not None:
        assert torch.equal(after.output, before.output), "forward output is not bitwise identical"


@pytest.fixture
def tiny_wan() -> nn.Module:
    return build_tiny_wan()


@pytest.fixture
def make_tiny_wan() -> Callable[..., nn.Module]:
    return build_tiny_wan


@pytest.fixture
def run_wan() -> Callable[..., torch.Tensor]:
    return wan_forward


@pytest.fixture
def model_fingerprint() -> Callable[..., ModelFingerprint]:
    return fingerprint


@pytest.fixture
def assert_restored() -> Callable[[ModelFingerprint, ModelFingerprint], None]:
    return assert_same_model
