"""Prepare-time refusals (named reasons) and conflicts with other accelerations."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from worldfoundry.base_models.diffusion_model.optimizations.refusals import (
    CUDA_GRAPH_MARKER,
)
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.prepared import (
    ROLE_FEATURE_CACHE,
    ROOT_MODULE,
    PreparedAcceleration,
)
from worldfoundry.errors import (
    AccelerationConflictError,
    AccelerationOptionsError,
    AccelerationRefusedError,
)

SPEC = {"resident_blocks": {"offload_resident_blocks": 1}}


def _refused(model, registry, fragment: str, spec=SPEC) -> None:
    state = {k: (v.device, v.data_ptr()) for k, v in model.state_dict().items()}
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    with pytest.raises(AccelerationRefusedError) as info:
        install_diffusion_accelerations(model, spec, registry=registry)
    assert info.value.plugin == "resident_blocks"
    assert fragment in info.value.reason
    assert {k: (v.device, v.data_ptr()) for k, v in model.state_dict().items()} == state  # nothing moved
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forwards


def test_training_mode(tiny, registry) -> None:
    _refused(tiny.make_tiny_wan().train(), registry, "training mode")


def test_compiled_block(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    model.blocks[0].compile()  # regional compile marks the module; nothing is compiled before a call
    _refused(model, registry, "torch.compile")


def test_cuda_graph_marker(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    setattr(model, CUDA_GRAPH_MARKER, True)
    _refused(model, registry, "CUDA graph")


def test_sequence_parallel(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    model._parallel_config = object()
    _refused(model, registry, "parallelism")


def test_diffusers_group_offloading(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    model.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    _refused(model, registry, "diffusers hooks")


def test_several_devices(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    model.proj_out.to("meta")
    _refused(model, registry, "several devices")


def test_unsupported_device(tiny, registry) -> None:
    _refused(tiny.make_tiny_wan().to("meta"), registry, "not supported")


def test_hooks_on_a_block(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    model.blocks[2].register_forward_pre_hook(lambda module, args: None)
    _refused(model, registry, "blocks.2 has forward hooks")


def test_tied_weights(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    model.blocks[1].ffn.net[2].weight = model.blocks[0].ffn.net[2].weight
    _refused(model, registry, "tied weights")
    model = tiny.make_tiny_wan()
    model.proj_out.bias = model.blocks[0].ffn.net[2].bias
    _refused(model, registry, "tied weights")


def test_non_contiguous_weight(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    w = model.blocks[0].attn1.to_q.weight
    w.data = w.data.t().contiguous().t()
    _refused(model, registry, "not contiguous")


def test_unsupported_model(registry) -> None:
    _refused(nn.Sequential(nn.Linear(2, 2)).eval(), registry, "not a supported DiT")


def test_options_errors_name_the_plugin(tiny, registry) -> None:
    with pytest.raises(AccelerationOptionsError, match="only 4 blocks"):
        install_diffusion_accelerations(tiny.make_tiny_wan(), {"resident_blocks": {"offload_resident_blocks": 5}},
                                        registry=registry)
    with pytest.raises(AccelerationOptionsError, match="unknown option"):
        install_diffusion_accelerations(tiny.make_tiny_wan(), {"resident_blocks": {"r": 1}}, registry=registry)


def _fake(name: str, claims: set[str], incompatible: set[str] = frozenset()):
    def factory(model, options, policy):
        return PreparedAcceleration(name, frozenset(claims), lambda: _NoopHandle(), frozenset(incompatible))

    return factory


class _NoopHandle:
    def deactivate(self) -> None:
        pass


def test_feature_cache_conflicts_both_ways(tiny, registry) -> None:
    registry.register("fake_cache", _fake("fake_cache", {ROOT_MODULE, ROLE_FEATURE_CACHE}))
    model = tiny.make_tiny_wan()
    with pytest.raises(AccelerationConflictError, match="resident_blocks"):
        install_diffusion_accelerations(model, {**SPEC, "fake_cache": {}}, registry=registry)
    assert "forward" not in model.blocks[0].__dict__


def test_a_plugin_replacing_a_block_conflicts(tiny, registry) -> None:
    registry.register("fake_fusion", _fake("fake_fusion", {"blocks.3"}))
    with pytest.raises(AccelerationConflictError, match="blocks.3"):
        install_diffusion_accelerations(tiny.make_tiny_wan(), {**SPEC, "fake_fusion": {}}, registry=registry)
