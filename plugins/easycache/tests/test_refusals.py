"""Prepare-time refusals (each names what it found), role conflicts and refusal while busy."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
from diffusers import (
    FirstBlockCacheConfig,
    WanTransformer3DModel,
    WanVACETransformer3DModel,
)

from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.prepared import (
    ROLE_APPROXIMATE_ATTENTION,
    ROLE_FEATURE_CACHE,
    ROLE_OFFLOAD,
    PreparedAcceleration,
    role,
)
from worldfoundry.core.acceleration.session import get_session
from worldfoundry.errors import (
    AccelerationConflictError,
    AccelerationOptionsError,
    AccelerationRefusedError,
    ModelBusyError,
)


def _refused(model, registry, match, **options):
    forward = model.__dict__.get("forward")
    with pytest.raises(AccelerationRefusedError, match=match) as info:
        install_diffusion_accelerations(model, {"easycache": options}, registry=registry)
    assert info.value.plugin == "easycache"
    assert get_session(model) is None
    assert model.__dict__.get("forward") is forward


def test_bad_options_fail_before_anything_changes(helpers, registry):
    model = helpers.tiny_wan()
    with pytest.raises(AccelerationOptionsError, match="unknown option"):
        install_diffusion_accelerations(model, {"easycache": {"threshhold": 0.1}}, registry=registry)
    assert get_session(model) is None


def test_torch_compile_is_refused(helpers, registry):
    model = helpers.tiny_wan()
    model.blocks[0].compile()
    _refused(model, registry, r"torch\.compile \(blocks\.0\)")


def test_cuda_graphs_are_refused(helpers, registry):
    model = helpers.tiny_wan()
    model._worldfoundry_cuda_graph = True
    _refused(model, registry, "CUDA graph")


def test_sequence_parallelism_is_refused(helpers, registry):
    model = helpers.tiny_wan()
    model._parallel_config = object()
    _refused(model, registry, "parallelism")


def test_diffusers_feature_cache_is_refused(helpers, registry):
    model = helpers.tiny_wan()
    model.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    _refused(model, registry, "FirstBlockCacheConfig via diffusers enable_cache")
    model.disable_cache()
    session = install_diffusion_accelerations(model, {"easycache": {}}, registry=registry)
    session.uninstall()


def test_cache_dit_is_refused(helpers, registry):
    model = helpers.tiny_wan()
    model._is_cached = True
    _refused(model, registry, "cache-dit")


def test_streaming_inputs_are_refused(helpers, registry):
    class StreamingWan(WanTransformer3DModel):
        def forward(self, hidden_states, timestep, encoder_hidden_states, kv_cache=None, return_dict=True):
            return super().forward(hidden_states, timestep, encoder_hidden_states, return_dict=return_dict)

    torch.manual_seed(0)
    model = StreamingWan(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=16,
                         freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32).eval()
    _refused(model, registry, r"streaming inputs.*\['kv_cache'\]")
    plain = helpers.tiny_wan()
    plain._worldfoundry_streaming = True
    _refused(plain, registry, "streaming inputs")


def test_vace_control_subgraph_is_refused(registry):
    torch.manual_seed(0)
    model = WanVACETransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                      text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
                                      vace_layers=[0], vace_in_channels=8).eval()
    _refused(model, registry, r"camera/control sub-graph: WanVACETransformer3DModel\.forward takes \['control_")


def test_offload_is_refused(helpers, registry):
    model = helpers.tiny_wan()
    model.blocks[1]._hf_hook = object()  # what accelerate's cpu_offload leaves behind
    _refused(model, registry, r"offload: accelerate hook on blocks\.1")
    grouped = helpers.tiny_wan()
    grouped.enable_group_offload(torch.device("cpu"), offload_device=torch.device("cpu"),
                                 offload_type="block_level", num_blocks_per_group=1)
    _refused(grouped, registry, "diffusers hooks are attached")


def test_approximate_attention_processor_is_refused(helpers, registry):
    model = helpers.tiny_wan()
    model.blocks[1].attn2.processor._attention_backend = "sage"
    _refused(model, registry, r"approximate attention backend 'sage' on blocks\.1\.attn2")


def test_inplace_residual_is_refused(helpers, registry):
    model = helpers.tiny_wan()
    model.blocks[0].inplace_residual = True
    _refused(model, registry, r"in-place residual updates on blocks\.0")


def test_training_mode_is_refused(helpers, registry):
    model = helpers.tiny_wan().train()
    _refused(model, registry, "training mode")


def test_unsupported_models_are_refused(helpers, registry):
    _refused(nn.Linear(4, 4), registry, "not a supported DiT")
    wider = helpers.tiny_wan(in_channels=4, out_channels=8)
    _refused(wider, registry, "out_channels 8 > in_channels 4")


@pytest.mark.parametrize(
    ("claim", "shared"),
    [
        (ROLE_OFFLOAD, ROLE_OFFLOAD),
        (ROLE_APPROXIMATE_ATTENTION, ROLE_APPROXIMATE_ATTENTION),
        (role("inplace_residual"), role("inplace_residual")),
        (ROLE_FEATURE_CACHE, ROLE_FEATURE_CACHE),
        ("<root>", "<root>"),
    ],
)
def test_conflicting_plugins_are_named(helpers, registry, claim, shared):
    def other(model, options, policy):
        return PreparedAcceleration(name="other_plugin", claims=frozenset({claim}), activate=lambda: None)

    registry.register("other_plugin", other)
    model = helpers.tiny_wan()
    with pytest.raises(AccelerationConflictError, match=f"'other_plugin'.*{shared}|{shared}.*'other_plugin'") as info:
        install_diffusion_accelerations(model, {"easycache": {}, "other_plugin": {}}, registry=registry)
    assert {info.value.first, info.value.second} == {"easycache", "other_plugin"}
    assert get_session(model) is None


def test_install_and_uninstall_are_refused_while_busy(helpers, registry):
    model = helpers.tiny_wan()
    loop = helpers.loop({"model": model})
    loop.guard.begin_request("busy")
    with pytest.raises(ModelBusyError, match="'busy'"):
        install_diffusion_accelerations(model, {"easycache": {}}, registry=registry)
    loop.guard.end_request("busy")
    session = install_diffusion_accelerations(model, {"easycache": {}}, registry=registry)
    loop.guard.begin_request("busy2")
    with pytest.raises(ModelBusyError, match="'busy2'"):
        session.uninstall()
    assert session.installed
    loop.guard.end_request("busy2")
    session.uninstall()
    assert not session.installed


def test_install_record_and_signature(helpers, registry):
    model = helpers.tiny_wan()
    signature = inspect.signature(model.forward)
    session = install_diffusion_accelerations(model, {"easycache": {"threshold": 0.1}}, registry=registry)
    record = session.receipt.to_json()["plugins"][0]
    assert record["claims"] == ["<root>", "role:feature_cache"]
    assert record["options"] == {"threshold": 0.1, "warmup_steps": 10, "final_dense_steps": 1,
                                 "branch_decision": "cond"}
    assert record["exact"] is False
    assert session.receipt.to_json()["execution_verified"] is False
    assert inspect.signature(model.forward) == signature
    session.uninstall()
