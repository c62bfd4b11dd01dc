"""Fixtures for the diffusers-pipeline tests: tiny pipelines and a fingerprint of what a module carries."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parent))

from pipelines import BUILDERS, TinyPipeline  # noqa: E402

#: Exact plugins and the options that make them engage on the tiny pipelines (K/V tokens are few).
EXACT_SPECS: dict[str, dict[str, Any]] = {
    "easycache": {"threshold": 0.0},
    "wan_cross_kv_fusion": {"min_tokens": 0},
    "optimized_mha": {},
    "resident_blocks": {"offload_resident_blocks": 1},
}
WAN_ONLY = {"wan_cross_kv_fusion"}


def spec_for(plugin: str, kind: str) -> dict[str, Any]:
    opts = dict(EXACT_SPECS[plugin])
    if plugin == "wan_cross_kv_fusion" and kind == "wan_i2v":
        opts["include_image"] = True
    return {plugin: opts}


def applicable(plugin: str, kind: str) -> bool:
    return not (plugin in WAN_ONLY and kind == "sana_video")


@pytest.fixture(params=sorted(BUILDERS))
def tiny(request: pytest.FixtureRequest) -> TinyPipeline:
    return BUILDERS[request.param]()


def carried(module: nn.Module) -> dict[str, Any]:
    """Every module's instance attributes and hook/child/parameter/buffer keys (identity of values)."""
    out: dict[str, Any] = {}
    for name, m in module.named_modules():
        out[name] = (
            {k: id(v) for k, v in m.__dict__.items() if not k.startswith("_") or k in ("_apply", "_diffusers_hook")
             or k.startswith("_worldfoundry") or k == "forward"},
            tuple(m._forward_pre_hooks), tuple(m._forward_hooks), tuple(m._modules), tuple(m._parameters),
            tuple(m._buffers), tuple(sorted(k for k in m.__dict__ if k.startswith("_worldfoundry"))),
            "forward" in m.__dict__, "_apply" in m.__dict__, "cache_context" in m.__dict__,
        )
    return out


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
