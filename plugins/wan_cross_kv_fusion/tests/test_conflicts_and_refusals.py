"""Options, conflicts (whatever the spec order), composition with optimized_mha self-only, refusals."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from worldfoundry_wan_cross_kv_fusion.options import Options

from worldfoundry import testing
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.prepared import ROLE_QUANTIZATION, PreparedAcceleration
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.errors import (
    AccelerationConflictError,
    AccelerationOptionsError,
    AccelerationRefusedError,
    ModelBusyError,
)


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- options


def test_options() -> None:
    assert Options.from_mapping({}) == Options(256, False)
    assert Options.from_mapping({"min_tokens": 0, "include_image": True}).to_json() == {
        "min_tokens": 0, "include_image": True, "pack": True}
    assert Options.from_mapping({"pack": False}).pack is False
    for bad, message in [({"min_token": 3}, r"unknown option\(s\) \['min_token'\]"),
                         ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
                         ({"min_tokens": True}, "min_tokens must be an integer"),
                         ({"min_tokens": 2.5}, "min_tokens must be an integer"),
                         ({"include_image": "yes"}, "include_image must be true or false"),
                         ({"pack": 1}, "pack must be true or false")]:
        with pytest.raises(AccelerationOptionsError, match=message):
            Options.from_mapping(bad)
    with pytest.raises(AccelerationOptionsError, match="must be a mapping"):
        Options.from_mapping(None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- conflicts


class ProjectionQuantizer:
    """A small real plugin that selects Linears by path (as selective_fp8 does) and scales nothing."""

    def __init__(self, name: str, paths: tuple[str, ...]) -> None:
        self.name = name
        self.paths = paths

    def __call__(self, model: nn.Module, options: Mapping[str, Any], policy: Any) -> PreparedAcceleration:
        return PreparedAcceleration(name=self.name, claims=frozenset(self.paths) | {ROLE_QUANTIZATION},
                                    activate=lambda: _NoChange())


class _NoChange:
    def deactivate(self) -> None:
        return None


@pytest.mark.parametrize("order", ["kv_first", "fp8_first"])
def test_a_plugin_selecting_the_same_kv_conflicts_in_any_order(wan, registry, order: str) -> None:  # noqa: ANN001
    registry.register("selective_fp8", ProjectionQuantizer("selective_fp8", ("blocks.1.attn2.to_v",)))
    entries = [("wan_cross_kv_fusion", {"min_tokens": 0}), ("selective_fp8", {})]
    spec = dict(entries if order == "kv_first" else entries[::-1])
    with pytest.raises(AccelerationConflictError) as info:
        install_diffusion_accelerations(wan.model, spec, registry=registry)
    assert {info.value.first, info.value.second} == {"wan_cross_kv_fusion", "selective_fp8"}
    assert info.value.resource == "blocks.1.attn2.to_v"
    assert "forward" not in wan.model.blocks[1].attn2.to_v.__dict__
    # selecting only other Linears composes
    registry.register("selective_fp8", ProjectionQuantizer("selective_fp8", ("blocks.1.ffn.net.2",)), replace=True)
    install_diffusion_accelerations(wan.model, spec, registry=registry).uninstall()


@pytest.mark.skipif(not _installed("worldfoundry-selective-fp8"), reason="selective_fp8 is not installed")
@pytest.mark.parametrize("order", ["fp8_first", "kv_first"])
def test_the_real_selective_fp8_conflicts_on_the_kv_projections(wan, order: str) -> None:  # noqa: ANN001
    registry = AccelerationRegistry(allowlist=["wan_cross_kv_fusion", "selective_fp8"])
    entries = [("selective_fp8", {"include": ["blocks.*.attn2.to_k"]}), ("wan_cross_kv_fusion", {"min_tokens": 0})]
    spec = dict(entries if order == "fp8_first" else entries[::-1])
    with pytest.raises(AccelerationConflictError, match="blocks.0.attn2.to_k") as info:
        install_diffusion_accelerations(wan.model, spec, registry=registry)
    assert {info.value.first, info.value.second} == {"wan_cross_kv_fusion", "selective_fp8"}


needs_mha = pytest.mark.skipif(not _installed("worldfoundry-optimized-mha"), reason="optimized_mha is not installed")


@needs_mha
@pytest.mark.parametrize("order", ["mha_first", "kv_first"])
def test_optimized_mha_cross_fusion_conflicts(wan, order: str) -> None:  # noqa: ANN001
    registry = AccelerationRegistry(allowlist=["optimized_mha", "wan_cross_kv_fusion"])
    entries = [("optimized_mha", {"cross": {"fusion": "kv"}}), ("wan_cross_kv_fusion", {"min_tokens": 0})]
    spec = dict(entries if order == "mha_first" else entries[::-1])
    with pytest.raises(AccelerationConflictError, match="blocks.0.attn2.to_k"):
        install_diffusion_accelerations(wan.model, spec, registry=registry)


@needs_mha
def test_optimized_mha_self_only_and_static_kv_together_are_bitwise(wan, record) -> None:  # noqa: ANN001
    registry = AccelerationRegistry(allowlist=["optimized_mha", "wan_cross_kv_fusion"])
    dense = wan.dense_outputs(3)
    spec = {"wan_cross_kv_fusion": {"min_tokens": 0}, "optimized_mha": {"self": {"fusion": "qkv"}}}
    session = install_diffusion_accelerations(wan.model, spec, registry=registry)
    assert session.receipt.exact is True
    outputs = wan.run_request("both", 3)
    assert all(torch.equal(a, b) for a, b in zip(outputs, dense, strict=True))
    assert record(session, "both")["counters"]["kv_cache_hit"] == 2 * 2 * 2
    mha = session.execution_report()["plugins"]["optimized_mha"]["model"]["requests"]["both"]
    assert mha["claimed_not_executed"] == [] and mha["counters"]["fused_qkv"] > 0
    session.uninstall()
    assert all(torch.equal(a, b) for a, b in zip(wan.dense_outputs(3), dense, strict=True))


def test_static_kv_roles_conflict(wan, registry) -> None:  # noqa: ANN001
    from worldfoundry.core.acceleration.prepared import ROLE_STATIC_KV_CACHE

    registry.register("other_kv_cache", lambda m, o, p: PreparedAcceleration(
        name="other_kv_cache", claims=frozenset({ROLE_STATIC_KV_CACHE}), activate=lambda: _NoChange()))
    with pytest.raises(AccelerationConflictError, match="role:static_kv_cache"):
        install_diffusion_accelerations(wan.model, {"wan_cross_kv_fusion": {}, "other_kv_cache": {}},
                                        registry=registry)


# ---------------------------------------------------------------------------------------------- refusals


def _refused(case, registry, match: str, options: dict | None = None) -> None:  # noqa: ANN001
    with pytest.raises(AccelerationRefusedError, match=match):
        install_diffusion_accelerations(case.model, {"wan_cross_kv_fusion": options or {}}, registry=registry)
    assert "_worldfoundry_accelerations" not in case.model.__dict__


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's inductor import on .compile()
def test_refusals(builders, registry) -> None:  # noqa: ANN001
    case = builders()
    case.model.blocks[0].compile()
    _refused(case, registry, "compiled")

    case = builders()
    case.model.blocks[1].attn2.to_k.register_forward_pre_hook(lambda m, i: None)
    _refused(case, registry, "blocks.1.attn2.to_k has forward hooks")

    case = builders()

    class Custom(WanAttnProcessor):
        pass

    case.model.blocks[0].attn2.set_processor(Custom())
    _refused(case, registry, "attention processor Custom")

    case = builders()
    case.model.fuse_qkv_projections()
    _refused(case, registry, "unfuse_qkv_projections")

    case = builders()
    case.model.train()
    _refused(case, registry, "training mode")

    case = builders()
    lin = case.model.blocks[0].attn2.to_v
    lin.weight = nn.Parameter(torch.zeros_like(lin.weight, dtype=torch.int8), requires_grad=False)
    _refused(case, registry, "cannot pack kv of blocks.0.attn2: .*int8")

    case = builders()
    case.model.blocks[0].attn2.to_v.to(torch.float64)
    _refused(case, registry, "one dtype and device")

    case = builders()
    case.model.blocks[0].attn2.processor._parallel_config = object()
    _refused(case, registry, "context parallelism")

    _refused(builders(), registry, "no image K/V projections", {"include_image": True})


def test_refuses_other_families(registry) -> None:  # noqa: ANN001
    sana = testing.tiny_sana_video(in_channels=4, out_channels=4, attention_head_dim=8, num_layers=1,
                                   cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=8, sample_size=4)
    with pytest.raises(AccelerationRefusedError, match="only Wan transformers"):
        install_diffusion_accelerations(sana, {"wan_cross_kv_fusion": {}}, registry=registry)


def test_install_and_uninstall_are_refused_while_busy(wan, registry) -> None:  # noqa: ANN001
    guard = attach_request_guard(wan.model)
    with guard.request("busy"):
        with pytest.raises(ModelBusyError, match="'busy'"):
            install_diffusion_accelerations(wan.model, {"wan_cross_kv_fusion": {}}, registry=registry)
    session = install_diffusion_accelerations(wan.model, {"wan_cross_kv_fusion": {}}, registry=registry)
    with guard.request("busy2"):
        with pytest.raises(ModelBusyError):
            session.uninstall()
    session.uninstall()


def test_entry_point_registers_the_plugin() -> None:
    if not _installed("worldfoundry-wan-cross-kv-fusion"):
        pytest.skip("the distribution is not installed")
    registry = AccelerationRegistry(allowlist=["wan_cross_kv_fusion"])
    assert registry.get("wan_cross_kv_fusion").distribution == "worldfoundry-wan-cross-kv-fusion"
