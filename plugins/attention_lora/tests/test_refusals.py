"""Refusals, conflicts, nesting and busy models: the adapter attaches nothing in each case."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from worldfoundry_attention_lora import (
    apply_dit_attention_lora,
    make_prepare,
    prepare_attention_lora,
)
from worldfoundry_attention_lora.source import state_dict_source

from worldfoundry import testing
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.handle import RecordedHandle
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.prepared import (
    ROLE_ATTENTION_ADAPTER,
    PreparedAcceleration,
)
from worldfoundry.core.acceleration.registry import (
    AccelerationRegistry,
    diffusion_acceleration_registry,
)
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import (
    AccelerationConflictError,
    AccelerationOptionsError,
    AccelerationRefusedError,
    ArtifactMismatchError,
    ModelBusyError,
    SessionAlreadyInstalledError,
)

RANK = 4


def _toy_factory(name: str, claims: frozenset[str]):
    def prepare(model, options, policy):
        return PreparedAcceleration(name=name, claims=claims,
                                    activate=lambda: RecordedHandle(name, PatchRecorder(name)))
    return prepare


def _assert_untouched(model: nn.Module) -> None:
    assert not hasattr(model, "_worldfoundry_accelerations")
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == []


@pytest.mark.parametrize("case", ["compiled", "training", "fused", "hook", "not_linear", "sequence_parallel",
                                  "gradient_checkpointing", "patched_forward"])
def test_model_states_are_refused(tools, case: str) -> None:
    model = tools.build_h3()
    adapter = tools.make_h3_adapter(model, RANK)
    match = {
        "compiled": "torch.compile", "training": "training mode", "fused": "fused QKV", "hook": "forward hooks",
        "not_linear": "not a plain torch Linear", "sequence_parallel": "parallelism",
        "gradient_checkpointing": "gradient checkpointing", "patched_forward": "already has a patched forward",
    }[case]
    if case == "compiled":
        model.transformer_blocks[1].compile()  # regional compile (lazy: nothing is traced here)
    elif case == "training":
        model.train()
    elif case == "fused":
        model.fuse_qkv_projections()
    elif case == "hook":
        model.transformer_blocks[0].attn.to_v.register_forward_hook(lambda *a: None)
    elif case == "not_linear":
        class MyLinear(nn.Linear):
            pass
        old = model.transformer_blocks[1].attn.to_out[0]
        new = MyLinear(old.in_features, old.out_features, bias=False)
        model.transformer_blocks[1].attn.to_out[0] = new
    elif case == "sequence_parallel":
        model.transformer_blocks[0].attn.processor._parallel_config = object()
    elif case == "gradient_checkpointing":
        model.gradient_checkpointing = True
    elif case == "patched_forward":
        to_k = model.transformer_blocks[0].attn.to_k
        to_k.forward = to_k.forward  # an instance-level forward someone else installed
    with pytest.raises(AccelerationRefusedError, match=match):
        with apply_dit_attention_lora(model, adapter.state, rank=RANK, scale=-1.0):
            pytest.fail("the body must not run")
    assert not hasattr(model, "_worldfoundry_accelerations")


def test_existing_peft_adapter_is_refused(tools) -> None:
    pytest.importorskip("peft")
    model = tools.build_wan()
    adapter = tools.make_wan_adapter(model, RANK)
    model.load_lora_adapter(dict(adapter.state), adapter_name="other", prefix=None)
    with pytest.raises(AccelerationRefusedError, match="already carries diffusers/PEFT adapters"):
        with apply_dit_attention_lora(model, adapter.state, rank=RANK, scale=-1.0):
            pytest.fail("the body must not run")


def test_unsupported_family_is_refused(tools) -> None:
    model = testing.tiny_sana_video(in_channels=4, out_channels=4, attention_head_dim=8, num_layers=1,
                                    cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=8,
                                    sample_size=4)
    with pytest.raises(AccelerationRefusedError, match="sana_video"):
        with apply_dit_attention_lora(model, {"blocks.0.attn1.to_q.lora_A.weight": torch.zeros(1, 1)}, rank=1, scale=1.0):
            pytest.fail("the body must not run")


def test_busy_model_is_refused(h3, tools) -> None:
    adapter = tools.make_h3_adapter(h3, RANK)
    guard = attach_request_guard(h3)
    guard.begin_request("running")
    try:
        with pytest.raises(ModelBusyError, match="running"):
            with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0):
                pytest.fail("the body must not run")
        _assert_untouched(h3)
    finally:
        guard.end_request("running")
    with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0) as session:
        guard.begin_request("r2")
        with pytest.raises(ModelBusyError):
            session.uninstall()
        guard.end_request("r2")
    _assert_untouched(h3)


def test_nested_use_is_an_error(h3, tools) -> None:
    adapter = tools.make_h3_adapter(h3, RANK)
    inputs = tools.h3_inputs(h3)
    with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0):
        outer = tools.run(h3, inputs)
        with pytest.raises(AccelerationRefusedError, match="already applied"):
            with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=1.0):
                pytest.fail("the inner body must not run")
        assert torch.equal(tools.run(h3, inputs), outer), "the failed inner use must not change the outer adapter"
    _assert_untouched(h3)


def test_other_session_must_be_uninstalled_first(h3, tools) -> None:
    registry = AccelerationRegistry(discover=False)
    registry.register("toy", _toy_factory("toy", frozenset({"proj_out"})))
    session = install_diffusion_accelerations(h3, {"toy": {}}, RuntimePolicy(), registry=registry)
    with pytest.raises(SessionAlreadyInstalledError, match="toy"):
        with apply_dit_attention_lora(h3, tools.make_h3_adapter(h3, RANK).state, rank=RANK, scale=-1.0):
            pytest.fail("the body must not run")
    session.uninstall()


@pytest.mark.parametrize("claim", [ROLE_ATTENTION_ADAPTER, "transformer_blocks.1.attn.to_k"])
def test_shared_role_or_projection_conflicts(h3, tools, claim: str) -> None:
    """Another attention adapter (same role) or a plugin rewriting an adapted projection (e.g. a fused QKV) conflicts."""
    registry = AccelerationRegistry(discover=False)
    registry.register("attention_lora", make_prepare(state_dict_source(tools.make_h3_adapter(h3, RANK).state)))
    registry.register("other_plugin", _toy_factory("other_plugin", frozenset({claim})))
    spec = {"attention_lora": {"rank": RANK, "scale": -1.0}, "other_plugin": {}}
    with pytest.raises(AccelerationConflictError, match=claim.replace(".", r"\.")):
        install_diffusion_accelerations(h3, spec, RuntimePolicy(), registry=registry)
    _assert_untouched(h3)


def test_optimized_mha_qkv_fusion_conflicts(h3, tools, tmp_path) -> None:
    registry = diffusion_acceleration_registry()
    if "optimized_mha" not in registry.names():
        pytest.skip("optimized_mha is not installed")
    from safetensors.torch import save_file

    path = tmp_path / "a.safetensors"
    save_file(tools.make_h3_adapter(h3, RANK).state, str(path))
    spec = {"optimized_mha": {"self": {"fusion": "qkv", "sdpa_backend": "torch"}},
            "attention_lora": {"path": str(path), "rank": RANK, "scale": -1.0}}
    with pytest.raises(AccelerationConflictError, match="to_[qkv]"):
        install_diffusion_accelerations(h3, spec, RuntimePolicy(), registry=registry)
    _assert_untouched(h3)


def test_missing_or_corrupt_file(h3, tmp_path) -> None:
    registry = AccelerationRegistry(discover=False)
    registry.register("attention_lora", prepare_attention_lora)
    missing = {"attention_lora": {"path": str(tmp_path / "nope.safetensors"), "rank": RANK, "scale": -1.0}}
    with pytest.raises(AccelerationOptionsError, match="cannot read adapter file"):
        install_diffusion_accelerations(h3, missing, RuntimePolicy(), registry=registry)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(ArtifactMismatchError, match="not a readable safetensors file"):
        install_diffusion_accelerations(h3, {"attention_lora": {**missing["attention_lora"], "path": str(corrupt)}},
                                        RuntimePolicy(), registry=registry)
    with pytest.raises(AccelerationOptionsError, match="missing required"):
        install_diffusion_accelerations(h3, {"attention_lora": {"rank": RANK, "scale": -1.0}}, RuntimePolicy(),
                                        registry=registry)
    _assert_untouched(h3)


def test_in_memory_state_must_be_tensors(h3) -> None:
    with pytest.raises(ArtifactMismatchError, match="'k': adapter states map string keys to tensors"):
        with apply_dit_attention_lora(h3, {"k": [1.0]}, rank=RANK, scale=-1.0):
            pytest.fail("the body must not run")
    with pytest.raises(TypeError, match="cannot find a transformer"):
        with apply_dit_attention_lora(object(), {}, rank=RANK, scale=-1.0):
            pytest.fail("the body must not run")
