"""A tiny seeded Wan transformer, its calibrated SVDQuant artifact, fixed inputs and a model fingerprint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

WAN_CONFIG: dict[str, Any] = dict(
    num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16, text_dim=32, freq_dim=32,
    ffn_dim=128, num_layers=2, rope_max_seq_len=64,
)
WAN_FFN_PATHS = ["blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2"]


def build_wan(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**WAN_CONFIG)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.05)
    return model.to(dtype).eval()


def wan_inputs(dtype: torch.dtype = torch.float32, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, 16, 2, 8, 8, generator=g).to(dtype),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g).to(dtype),
    }


def run_wan(model: nn.Module, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    """One forward on the inputs of ``seed``, moved to the model's device."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in wan_inputs(dtype, seed).items()}
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def calibrate(model: nn.Module, out: Path, *, method: str = "svdquant", rank: int = 16, group_size: int = 64,
              include: tuple[str, ...] = ("blocks.*.ffn.0", "blocks.*.ffn.2")) -> Path:
    """Calibrate on inputs of seeds 11/12 and write the artifact (``.json`` or ``.pt`` by suffix)."""
    from worldfoundry.base_models.diffusion_model.svdquant_calibration import (
        InputAbsmaxObserver,
        build_svdquant_artifact,
        select_for_calibration,
    )
    from worldfoundry.core.acceleration.quantization.svdquant_artifact import save_svdquant_artifact

    dtype = next(model.parameters()).dtype
    selected = select_for_calibration(model, include)
    with InputAbsmaxObserver(selected) as obs:
        for seed in (11, 12):
            run_wan(model, dtype, seed)
    manifest, tensors = build_svdquant_artifact(model, selected, obs.absmax, method=method, rank=rank,
                                                group_size=group_size, include=include,
                                                calibration={"seeds": [11, 12]}, observer=obs)
    return save_svdquant_artifact(manifest, tensors, out)


def fingerprint(model: nn.Module) -> dict[str, Any]:
    tree = []
    for name, module in model.named_modules(remove_duplicate=False):
        attrs = {k: id(v) for k, v in module.__dict__.items()}
        containers = {k: [(key, id(v)) for key, v in module.__dict__[k].items()]
                      for k in ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks")}
        tree.append((name, id(module), attrs, containers))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"tree": tree, "state": state, "output": run_wan(model, next(model.parameters()).dtype)}


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    skip = {""}  # the request guard on the root stays attached by design
    assert [e for e in after["tree"] if e[0] not in skip] == [e for e in before["tree"] if e[0] not in skip]
    assert list(after["state"]) == list(before["state"])
    for k, v in before["state"].items():
        assert after["state"][k].dtype == v.dtype and torch.equal(after["state"][k], v), k
    assert torch.equal(after["output"], before["output"]), "forward output is not bitwise identical"


class Kit:
    WAN_FFN_PATHS = WAN_FFN_PATHS
    build_wan = staticmethod(build_wan)
    wan_inputs = staticmethod(wan_inputs)
    run_wan = staticmethod(run_wan)
    calibrate = staticmethod(calibrate)
    fingerprint = staticmethod(fingerprint)
    assert_same = staticmethod(assert_same)


@pytest.fixture
def kit() -> type[Kit]:
    return Kit


@pytest.fixture
def wan() -> nn.Module:
    return build_wan()


@pytest.fixture
def artifact(wan: nn.Module, tmp_path: Path) -> Path:
    return calibrate(wan, tmp_path / "svdquant.json")
