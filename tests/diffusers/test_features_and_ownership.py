"""diffusers features next to the accelerations, in both orders, and uninstall keeping what the user did.

Every (feature, plugin) pair either composes bitwise (the accelerated pipeline equals vanilla diffusers with the
same feature, and so does the pipeline after uninstall, the feature still applied) or is refused — at install
when the feature came first, at the feature's call when the plugin came first — with a message naming both.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT_SPECS
from features import FEATURES, lora_state_dict, write_attention_adapter
from pipelines import wan_t2v

import worldfoundry
from worldfoundry.errors import AccelerationRefusedError, InferenceViewError, OwnershipCollisionError

PLUGINS = sorted(EXACT_SPECS)
#: (feature, plugin) pairs refused when the feature comes after install (at the feature's call).
REFUSED_AFTER = {
    ("enable_layerwise_casting", "wan_cross_kv_fusion"), ("enable_layerwise_casting", "resident_blocks"),
    ("enable_group_offload", "resident_blocks"),
    ("fuse_qkv_projections", "optimized_mha"), ("fuse_qkv_projections", "wan_cross_kv_fusion"),
}
#: features every plugin refuses at install (it cannot wrap what the feature's hooks already wrap) ...
REFUSED_BEFORE_ALL = {"enable_cache", "enable_layerwise_casting", "enable_group_offload"}
#: ... and pairs refused at install for a plugin-specific reason
REFUSED_BEFORE = {("load_lora_weights", "wan_cross_kv_fusion"), ("load_lora_weights", "optimized_mha"),
                  ("fuse_lora", "wan_cross_kv_fusion"), ("fuse_lora", "optimized_mha"),
                  ("fuse_qkv_projections", "wan_cross_kv_fusion"), ("fuse_qkv_projections", "optimized_mha")}


def _with_feature(feature: str) -> torch.Tensor:
    reference = wan_t2v()
    FEATURES[feature](reference.pipe)
    return reference.run()


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_feature_after_install_composes_or_is_refused_at_its_call(feature, plugin):
    want = _with_feature(feature)
    tp = wan_t2v()
    accel = worldfoundry.accelerate(tp.pipe, {plugin: EXACT_SPECS[plugin]})
    if (feature, plugin) in REFUSED_AFTER:
        with pytest.raises(InferenceViewError, match=rf"{feature.split('_')[0]}.*{plugin}.*uninstall {plugin} first"):
            FEATURES[feature](tp.pipe)
        accel.uninstall()
        assert torch.equal(tp.run(), wan_t2v().run())  # the refused call changed nothing
        return
    FEATURES[feature](tp.pipe)
    assert torch.equal(tp.run(), want)
    accel.uninstall()
    assert torch.equal(tp.run(), want), "uninstall must keep the user's feature"


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_feature_before_install_composes_or_is_refused_at_install(feature, plugin):
    want = _with_feature(feature)
    tp = wan_t2v()
    FEATURES[feature](tp.pipe)
    if feature in REFUSED_BEFORE_ALL or (feature, plugin) in REFUSED_BEFORE:
        with pytest.raises(AccelerationRefusedError, match=plugin):
            worldfoundry.accelerate(tp.pipe, {plugin: EXACT_SPECS[plugin]})
        assert "_worldfoundry_accelerations" not in tp.pipe.__dict__
        assert torch.equal(tp.run(), want)
        return
    accel = worldfoundry.accelerate(tp.pipe, {plugin: EXACT_SPECS[plugin]})
    assert torch.equal(tp.run(), want)
    accel.uninstall()
    assert torch.equal(tp.run(), want)


@pytest.mark.parametrize("plugin", ["easycache", "optimized_mha", "wan_cross_kv_fusion"])
def test_lora_loaded_and_unloaded_while_installed(plugin):
    vanilla = wan_t2v().run()
    tp = wan_t2v()
    accel = worldfoundry.accelerate(tp.pipe, {plugin: EXACT_SPECS[plugin]})
    tp.pipe.load_lora_weights(lora_state_dict(), adapter_name="user")
    assert not torch.equal(tp.run(), vanilla)
    tp.pipe.unload_lora_weights()
    assert torch.equal(tp.run(), vanilla)
    accel.uninstall()
    assert torch.equal(tp.run(), vanilla)


def test_a_wrapper_on_a_patched_forward_is_a_collision_named_before_anything_changes():
    tp = wan_t2v()
    vanilla = tp.run()
    accel = worldfoundry.accelerate(tp.pipe, {"easycache": {"threshold": 0.0}, "optimized_mha": {}})
    model = tp.pipe.transformer
    ours = model.forward

    def user_forward(*args, **kwargs):
        return ours(*args, **kwargs)

    model.forward = user_forward
    with pytest.raises(OwnershipCollisionError, match=r"easycache.*WanTransformer3DModel\.forward.*Undo those") as err:
        accel.uninstall()
    assert len(err.value.collisions) == 1
    assert accel.installed and model.forward is user_forward  # nothing changed
    assert torch.equal(tp.run(), vanilla)
    del model.forward  # the user takes their wrapper off: now uninstall can proceed
    model.forward = ours
    accel.uninstall()
    assert "forward" not in model.__dict__ and torch.equal(tp.run(), vanilla)


def test_fuse_qkv_projections_after_an_attention_adapter_is_refused(tmp_path):
    options = write_attention_adapter(tmp_path)
    tp = wan_t2v()
    vanilla = tp.run()
    accel = worldfoundry.accelerate(tp.pipe, {"attention_lora": options})
    adapted = tp.run()
    assert not torch.equal(adapted, vanilla)
    with pytest.raises(InferenceViewError, match="fuse_qkv_projections.*drop the adapter.*uninstall attention_lora"):
        tp.pipe.transformer.fuse_qkv_projections()
    with pytest.raises(InferenceViewError, match="fuse_projections"):
        tp.pipe.transformer.blocks[0].attn1.fuse_projections()
    assert torch.equal(tp.run(), adapted)
    accel.uninstall()
    tp.pipe.transformer.fuse_qkv_projections()  # allowed again, and exact
    assert torch.equal(tp.run(), vanilla)


def test_accelerate_offload_hook_is_refused_by_resident_blocks_at_install():
    from accelerate.hooks import ModelHook, add_hook_to_module

    tp = wan_t2v()
    add_hook_to_module(tp.pipe.transformer, ModelHook())
    with pytest.raises(AccelerationRefusedError, match="resident_blocks.*accelerate offload hooks"):
        worldfoundry.accelerate(tp.pipe, {"resident_blocks": EXACT_SPECS["resident_blocks"]})
    assert "_worldfoundry_accelerations" not in tp.pipe.__dict__
    assert "_worldfoundry_guard" not in tp.pipe.transformer.__dict__  # a refused install leaves no guard
