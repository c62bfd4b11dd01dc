"""Options, refusals, conflicts, busy refusal and registration of ``wan_block_fusion`` / ``sana_block_fusion``."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.errors import (
    AccelerationConflictError,
    AccelerationOptionsError,
    AccelerationRefusedError,
    ModelBusyError,
)
from worldfoundry_block_fusion.options import (
    SANA_CHAINS,
    WAN_CHAINS,
    WAN_DEFAULT_CHAINS,
    SanaOptions,
    WanOptions,
)


def test_options_defaults_and_errors() -> None:
    assert WanOptions.from_mapping({}).chains == WAN_DEFAULT_CHAINS
    assert set(WAN_CHAINS) - set(WAN_DEFAULT_CHAINS) == {"float_carry"}  # nothing to carry beside layer_norm
    assert SanaOptions.from_mapping(None).chains == SANA_CHAINS
    assert WanOptions.from_mapping({"blocks": [2, 0], "min_tokens": 64}).to_json() == {
        "chains": list(WAN_DEFAULT_CHAINS), "min_tokens": 64, "blocks": [2, 0], "kernel_compile": "auto"}
    cases = [({"kernel_compile": "lazy"}, "kernel_compile"),
             ({"chain": ["rope"]}, "unknown option"), ({"chains": ["linear_attention"]}, "chains\\[0\\]"),
             ({"chains": []}, "chains"), ({"chains": ["rope", "rope"]}, "twice"), ({"min_tokens": -1}, "min_tokens"),
             ({"blocks": [-1]}, "blocks\\[0\\]"), ({"chains": ["float_carry"]}, "float_carry needs")]
    for options, match in cases:
        with pytest.raises(AccelerationOptionsError, match=match):
            WanOptions.from_mapping(options, path="accelerations.wan_block_fusion")
    with pytest.raises(AccelerationOptionsError, match="chains\\[0\\]"):
        SanaOptions.from_mapping({"chains": ["rope"]})


def _refused(model, match: str, registry, options=None, name: str = "wan_block_fusion",  # noqa: ANN001
             patched: tuple = ()) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AccelerationRefusedError, match=match):
        install_diffusion_accelerations(model, {name: options or {}}, registry=registry)
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert not hasattr(model, "_worldfoundry_accelerations") or model._worldfoundry_accelerations is None
    assert [m for m in model.modules() if "forward" in vars(m)] == list(patched)


def test_refusals(kit) -> None:  # noqa: ANN001
    reg = kit.make_registry()
    model = kit.build_wan()
    model.blocks[0].compile()
    _refused(model, "compiled", reg)

    model = kit.build_wan()
    model.train()
    _refused(model, "training mode", reg)

    model = kit.build_wan()

    class Custom(WanAttnProcessor):
        pass

    model.blocks[1].attn1.set_processor(Custom())
    _refused(model, "custom attention processor Custom", reg)
    install_diffusion_accelerations(model, {"wan_block_fusion": {"chains": ["modulate"]}}, registry=reg).uninstall()

    model = kit.build_wan()
    model.blocks[1].register_forward_pre_hook(lambda m, a: None)
    _refused(model, "blocks.1 has forward hooks", reg)

    model = kit.build_wan()
    model.blocks[0].attn1.register_forward_hook(lambda m, a, o: None)
    _refused(model, "blocks.0.attn1 has forward hooks", reg)

    model = kit.build_wan()
    model.blocks[0].forward = model.blocks[0].forward
    _refused(model, "blocks.0.forward is already replaced", reg, patched=(model.blocks[0],))

    with pytest.raises(AccelerationOptionsError, match="has 2 blocks, no index \\[5\\]"):
        install_diffusion_accelerations(kit.build_wan(), {"wan_block_fusion": {"blocks": [5]}}, registry=reg)
    _refused(kit.build_sana(), "this model is sana_video \\(use sana_block_fusion\\)", reg)
    _refused(kit.build_wan(), "this model is wan \\(use wan_block_fusion\\)", reg, name="sana_block_fusion")


def test_conflicts_are_named(kit) -> None:  # noqa: ANN001
    reg = kit.full_registry()
    model = kit.build_wan()
    with pytest.raises(AccelerationConflictError, match="resident_blocks.*wan_block_fusion|wan_block_fusion.*"
                                                        "resident_blocks"):
        install_diffusion_accelerations(model, {"wan_block_fusion": {}, "resident_blocks": {"offload_resident_blocks": 1}},
                                        registry=reg)
    assert all("forward" not in vars(m) for m in model.modules())


def test_install_and_uninstall_are_refused_while_busy(kit) -> None:  # noqa: ANN001
    reg = kit.make_registry()
    model = kit.build_wan()
    guard = attach_request_guard(model)
    with guard.request("busy"):
        with pytest.raises(ModelBusyError, match="'busy'"):
            install_diffusion_accelerations(model, {"wan_block_fusion": {}}, registry=reg)
    session = install_diffusion_accelerations(model, {"wan_block_fusion": {}}, registry=reg)
    with guard.request("busy2"):
        with pytest.raises(ModelBusyError):
            session.uninstall()
    session.uninstall()


def test_entry_points_register_both_names() -> None:
    try:
        importlib.metadata.distribution("worldfoundry-block-fusion")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the distribution is not installed")
    registry = AccelerationRegistry(allowlist=["worldfoundry-block-fusion"])
    assert {"wan_block_fusion", "sana_block_fusion"} <= set(registry.names())
    assert registry.get("sana_block_fusion").distribution == "worldfoundry-block-fusion"
    assert registry.get("wan_block_fusion").options is WanOptions
