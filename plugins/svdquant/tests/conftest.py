"""A tiny seeded Wan transformer, its calibrated SVDQuant artifact, fixed inputs and a model fingerprint."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn as nn

from worldfoundry import testing

WAN_CONFIG: dict[str, Any] = dict(testing.WAN_TINY)
WAN_FFN_PATHS = ["blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2"]


def build_wan(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    return testing.tiny_wan(seed, weight_scale=0.05, dtype=dtype, **WAN_CONFIG)


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
              include: tuple[str, ...] = ("blocks.*.ffn.0", "blocks.*.ffn.2"), unsmoothed: tuple[str, ...] = ()) -> Path:
    """Calibrate on inputs of seeds 11/12 and write the artifact (``.json`` or ``.pt`` by suffix); ``unsmoothed``
    Linears are decomposed without smoothing."""
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
                                                calibration={"seeds": [11, 12]}, observer=obs,
                                                unsmoothed=unsmoothed)
    return save_svdquant_artifact(manifest, tensors, out)


def cuda_case(tmp_path: Path, *, model: nn.Module | None = None, **calibrate_kw: Any) -> tuple[Any, ...]:
    """``(model, artifact, registry, inputs, dense output)`` on CUDA in bfloat16: the tiny Wan (or ``model``),
    calibrated with ``calibrate_kw``, a registry holding only ``svdquant``, and the dense forward."""
    from worldfoundry_svdquant.plugin import prepare

    from worldfoundry.core.acceleration.registry import AccelerationRegistry

    model = model if model is not None else build_wan(dtype=torch.bfloat16).cuda()
    artifact = calibrate(model, tmp_path / "case.json", **calibrate_kw)
    reg = AccelerationRegistry(discover=False)
    reg.register("svdquant", prepare)
    inputs = {k: v.cuda() for k, v in wan_inputs(torch.bfloat16).items()}
    with torch.inference_mode():
        dense = model(**inputs, return_dict=False)[0]
    return model, artifact, reg, inputs, dense


def install(model: nn.Module, artifact: Path, **options: Any) -> Any:
    """Install ``svdquant`` alone (a registry without discovery) with ``artifact`` and ``options``."""
    from worldfoundry_svdquant.plugin import prepare

    from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
    from worldfoundry.core.acceleration.registry import AccelerationRegistry
    from worldfoundry.core.model_loading.policy import RuntimePolicy

    reg = AccelerationRegistry(discover=False)
    reg.register("svdquant", prepare)
    return install_diffusion_accelerations(model, {"svdquant": {"artifact": str(artifact), **options}},
                                           RuntimePolicy(), registry=reg)


def fingerprint(model: nn.Module) -> testing.ModelFingerprint:
    """:func:`worldfoundry.testing.fingerprint` of the guarded model (the request guard stays by design)."""
    dtype = next(model.parameters()).dtype
    return testing.fingerprint(testing.guarded(model), forward=lambda m: run_wan(m, dtype))


assert_same = testing.assert_same_model


@pytest.fixture
def kit() -> ModuleType:
    """This module's helpers (conftest modules are not importable under importlib mode)."""
    return sys.modules[__name__]


@pytest.fixture
def wan() -> nn.Module:
    return build_wan()


@pytest.fixture
def artifact(wan: nn.Module, tmp_path: Path) -> Path:
    return calibrate(wan, tmp_path / "svdquant.json")
