"""``prepare``: selection per model family, claims and declared incompatibilities, and every refusal
(raised before any change: the model's fingerprint is unchanged and no session is attached)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from worldfoundry_selective_fp8.plugin import default_include, prepare

from worldfoundry import testing
from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.prepared import (
    ROLE_APPROXIMATE_ATTENTION,
    ROLE_FEATURE_CACHE,
    ROLE_OFFLOAD,
    ROLE_QUANTIZATION,
    ROLE_STATIC_KV_CACHE,
    ROLE_WEIGHT_VIEW,
)
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.acceleration.session import get_session
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import AccelerationRefusedError

POLICY = RuntimePolicy()
WAN_FFN_PATHS = ["blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2"]


def plan_for(model: nn.Module, **options):
    return prepare(model, options, POLICY)


def registry() -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("selective_fp8", prepare)
    return reg


def test_wan_default_selects_the_ffn_linears_and_claims_roles(wan):
    plan = plan_for(wan)
    assert plan.name == "selective_fp8" and plan.exact is False
    assert plan.claims == frozenset(WAN_FFN_PATHS) | {"blocks.0.ffn", "blocks.1.ffn", ROLE_QUANTIZATION,
                                                      ROLE_WEIGHT_VIEW}
    assert plan.incompatible_with == {
        ROLE_FEATURE_CACHE, ROLE_STATIC_KV_CACHE, ROLE_OFFLOAD, ROLE_APPROXIMATE_ATTENTION}
    assert plan.options["include"] == ["blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2"]
    # memory: 4 Linears of 64x128 -> 4 * (8192 + 4*out) bytes, stated as an addition, not a saving
    note = next(n for n in plan.notes if "MiB" in n)
    assert "keeps the dense weights" in note and "does not save memory" in note and "4 Linear(s)" in note


def test_wan_explicit_include_and_exclude(wan):
    plan = plan_for(wan, include=["blocks.*.attn2.to_k", "blocks.*.attn2.to_v"], exclude=["blocks.1.*"])
    assert plan.claims == {"blocks.0.attn2.to_k", "blocks.0.attn2.to_v", ROLE_QUANTIZATION, ROLE_WEIGHT_VIEW}


def test_minimax_h3_default_selects_its_ffn(kit):
    model = kit.build_minimax_h3()
    assert default_include(model) == ("transformer_blocks.*.ff.net.0.proj", "transformer_blocks.*.ff.net.2")
    plan = plan_for(model)
    assert {c for c in plan.claims if not c.startswith("role:")} == {
        "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.ff.net.2",
        "transformer_blocks.1.ff.net.0.proj", "transformer_blocks.1.ff.net.2"}


def test_sana_video_needs_explicit_attention_patterns(kit):
    model = kit.build_sana_video()
    with pytest.raises(AccelerationRefusedError, match="no Linear FFN.*transformer_blocks.\\*.attn1.to_q"):
        plan_for(model)
    plan = plan_for(model, include=["transformer_blocks.*.attn2.to_q", "transformer_blocks.*.attn2.to_out.0"])
    assert {c for c in plan.claims if not c.startswith("role:")} == {
        "transformer_blocks.0.attn2.to_q", "transformer_blocks.0.attn2.to_out.0",
        "transformer_blocks.1.attn2.to_q", "transformer_blocks.1.attn2.to_out.0"}


def test_prepare_changes_nothing(wan, kit):
    before = kit.fingerprint(wan)
    plan_for(wan)
    kit.assert_same(before, kit.fingerprint(wan))


def _hook_on_target(model):
    model.blocks[0].ffn.net[2].register_forward_hook(lambda m, a, o: o)


def _pre_hook_on_target(model):
    model.blocks[1].ffn.net[0].proj.register_forward_pre_hook(lambda m, a: None)


def _tie(model):
    model.blocks[1].ffn.net[2].weight = model.blocks[0].ffn.net[2].weight


def _subclass(model):
    class Doubling(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model.blocks[0].ffn.net[2] = Doubling(128, 64)


def _custom_forward(model):
    linear = model.blocks[0].ffn.net[2]
    linear.forward = lambda x: nn.functional.linear(x, linear.weight)


def _diffusers_cache(model):
    from diffusers import FirstBlockCacheConfig

    model.enable_cache(FirstBlockCacheConfig(threshold=0.1))


REFUSALS = {
    "empty match": ({"include": ["blocks.*.ff.net.2"]}, None, "matches no nn.Linear.*near matches"),
    "hook on target": ({}, _hook_on_target, "blocks.0.ffn.net.2 has forward hooks"),
    "pre-hook on target": ({}, _pre_hook_on_target, "blocks.1.ffn.net.0.proj has forward hooks"),
    "shared storage": ({}, _tie, "shares parameter storage"),
    "linear subclass": ({}, _subclass, "Linear subclasses.*Doubling"),
    "custom forward": ({}, _custom_forward, "replaced forward.*blocks.0.ffn.net.2"),
    "gradient checkpointing": ({}, lambda m: m.enable_gradient_checkpointing(), "gradient checkpointing"),
    "training mode": ({}, lambda m: m.train(), "training mode"),
    "compile": ({}, lambda m: m.blocks[0].compile(), "torch.compile"),
    "cuda graphs": ({}, lambda m: setattr(m, "_worldfoundry_cuda_graph", True), "CUDA graph"),
    "sequence parallel": ({}, lambda m: setattr(m, "_parallel_config", object()), "parallelism"),
    "diffusers hooks": ({}, _diffusers_cache, "diffusers hooks"),
    "float64 weights": ({}, lambda m: m.blocks[0].ffn.net[2].double(), "bfloat16, float16 or float32"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_happen_before_any_change(case, kit):
    options, break_model, message = REFUSALS[case]
    model = kit.build_wan()
    if break_model is not None:
        break_model(model)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_attrs = {n: dict(m.__dict__) for n, m in model.named_modules()}
    with pytest.raises(AccelerationRefusedError, match=message) as info:
        install_diffusion_accelerations(model, {"selective_fp8": options}, POLICY, registry=registry())
    assert info.value.plugin == "selective_fp8"
    assert get_session(model) is None
    after_attrs = {n: dict(m.__dict__) for n, m in model.named_modules()}
    for name, attrs in before_attrs.items():
        assert {k for k in after_attrs[name] if k != "_worldfoundry_guard"} == {
            k for k in attrs if k != "_worldfoundry_guard"}, name
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before_state.items())


def test_misaligned_dimensions_are_listed():
    model = testing.tiny_wan(weight_scale=None, ffn_dim=120)
    with pytest.raises(AccelerationRefusedError) as info:
        plan_for(model)
    message = str(info.value)
    assert "torch._scaled_mm needs in_features and out_features divisible by 16" in message
    for i in (0, 1):
        assert f"blocks.{i}.ffn.net.0.proj (out_features=120)" in message
        assert f"blocks.{i}.ffn.net.2 (in_features=120)" in message


def test_unsupported_model_without_include_is_refused_and_with_include_accepted():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).eval()
    with pytest.raises(AccelerationRefusedError, match="not a supported DiT"):
        plan_for(model)
    assert plan_for(model, include=["*"]).claims >= {"0", "2"}


def test_hooks_on_parent_modules_are_allowed(wan):
    wan.blocks[0].ffn.register_forward_hook(lambda m, a, o: o)
    wan.blocks[0].register_forward_pre_hook(lambda m, a: None)
    assert plan_for(wan).claims >= set(WAN_FFN_PATHS)
