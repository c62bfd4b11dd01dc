"""The out-of-tree example distribution (docs/examples/third_party_plugin), found through its entry point."""

from __future__ import annotations

import dataclasses
import importlib.metadata as importlib_metadata
import inspect
import json

import pytest
import torch
import torch.nn.functional as F

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV, AccelerationRegistry
from worldfoundry.core.acceleration.session import runtime_optimization_report
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import AccelerationOptionsError, AccelerationRefusedError, ModelBusyError

NAME = "example_gelu_tanh"
DISTRIBUTION = "worldfoundry-example-gelu-tanh"
POLICY = RuntimePolicy(device="cpu", dtype=torch.float32)


@pytest.fixture
def registry(monkeypatch) -> AccelerationRegistry:
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)
    return AccelerationRegistry()


def test_the_example_distribution_is_installed_with_its_entry_point():
    dist = importlib_metadata.distribution(DISTRIBUTION)
    eps = [ep for ep in dist.entry_points if ep.group == "worldfoundry.accelerations"]
    assert [(ep.name, ep.value) for ep in eps] == [(NAME, "worldfoundry_example_gelu_tanh.plugin")]


def test_discovered_through_the_entry_point(registry):
    entry = registry.get(NAME)
    assert entry.distribution == DISTRIBUTION
    assert entry.version == importlib_metadata.version(DISTRIBUTION)
    assert entry.entry_point == f"{NAME} = worldfoundry_example_gelu_tanh.plugin"
    record = next(r for r in registry.load_records() if r.entry_point == NAME)
    assert record.status == "loaded" and record.names == (NAME,)


def test_allowlist_can_exclude_it(monkeypatch):
    monkeypatch.setenv(PLUGIN_ALLOWLIST_ENV, "some_other_plugin")
    assert NAME not in AccelerationRegistry()
    monkeypatch.setenv(PLUGIN_ALLOWLIST_ENV, DISTRIBUTION)
    assert NAME in AccelerationRegistry()


def test_runs_on_a_tiny_wan_and_restores_it(registry, tiny_wan, run_wan, model_fingerprint, assert_restored):
    guard = attach_request_guard(tiny_wan)
    before = model_fingerprint(tiny_wan)
    signature = inspect.signature(tiny_wan.blocks[0].ffn.net[0].forward)
    session = install_diffusion_accelerations(tiny_wan, {NAME: True}, POLICY, registry=registry)
    record = session.receipt.plugins[0]
    assert record.exact is False and record.distribution == DISTRIBUTION
    assert record.claims == ("blocks.0.ffn.net.0", "blocks.1.ffn.net.0")
    assert inspect.signature(tiny_wan.blocks[0].ffn.net[0].forward) == signature

    with guard.request("r1"), request_scope(RequestContext("r1")):
        out = run_wan(tiny_wan)
    # The explicit formula computes the same function; whether it rounds like PyTorch's fused GELU depends on the
    # CPU's vector code (bitwise equal on some machines, not on others), so only the function is asserted here and
    # the receipts below prove the explicit path ran.
    torch.testing.assert_close(out, before.output, rtol=1e-5, atol=1e-5)

    report = runtime_optimization_report(tiny_wan)
    json.dumps(report)
    r1 = report["plugins"][NAME]["model"]["requests"]["r1"]
    assert r1["modules"] == {"blocks.0.ffn.net.0": {"kernel": 1}, "blocks.1.ffn.net.0": {"kernel": 1}}
    assert r1["claimed_not_executed"] == [] and r1["fallbacks"] == {} and r1["finished"] is True

    session.uninstall()
    assert_restored(before, model_fingerprint(tiny_wan))


def test_options_select_blocks_and_fall_back_below_min_numel(registry, tiny_wan, run_wan):
    session = install_diffusion_accelerations(tiny_wan, {NAME: {"blocks": [1], "min_numel": 10**9}}, POLICY,
                                              registry=registry)
    assert session.receipt.plugins[0].claims == ("blocks.1.ffn.net.0",)
    assert session.receipt.plugins[0].options == {"blocks": [1], "min_numel": 10**9}
    with request_scope(RequestContext("small")):
        run_wan(tiny_wan)
    r = session.execution_report()["plugins"][NAME]["model"]["requests"]["small"]
    assert r["counters"] == {"dense_fallback": 1}
    assert r["claimed_not_executed"] == ["blocks.1.ffn.net.0"]  # a fallback is not an execution
    assert list(r["module_fallbacks"]) == ["blocks.1.ffn.net.0"]
    session.uninstall()


@pytest.mark.parametrize(("options", "message"), [
    ({"block": [0]}, r"unknown option\(s\) \['block'\]; known options: \['blocks', 'min_numel'\]"),
    ({"blocks": [5]}, "block 5 does not exist"),
    ({"blocks": [0, 0]}, "twice"),
    ({"blocks": "0"}, "list of block indices"),
    ({"min_numel": -1}, "min_numel"),
    ({"min_numel": True}, "min_numel"),
])
def test_bad_options_are_named(registry, tiny_wan, options, message):
    with pytest.raises(AccelerationOptionsError, match=message):
        install_diffusion_accelerations(tiny_wan, {NAME: options}, POLICY, registry=registry)
    assert "_worldfoundry_accelerations" not in tiny_wan.__dict__


def test_refusals(registry, tiny_wan):
    tiny_wan.train()
    with pytest.raises(AccelerationRefusedError, match="training mode"):
        install_diffusion_accelerations(tiny_wan, {NAME: True}, POLICY, registry=registry)
    tiny_wan.eval()
    tiny_wan.blocks[0].ffn.net[0].register_forward_hook(lambda m, a, o: None)
    with pytest.raises(AccelerationRefusedError, match="forward hooks"):
        install_diffusion_accelerations(tiny_wan, {NAME: True}, POLICY, registry=registry)
    with pytest.raises(AccelerationRefusedError, match="not a supported DiT"):
        install_diffusion_accelerations(torch.nn.Linear(2, 2), {NAME: True}, POLICY, registry=registry)


def test_busy_model_is_refused(registry, tiny_wan):
    guard = attach_request_guard(tiny_wan)
    with guard.request("running"), pytest.raises(ModelBusyError, match="running"):
        install_diffusion_accelerations(tiny_wan, {NAME: True}, POLICY, registry=registry)


def test_kernel_matches_the_torch_reference():
    from worldfoundry_example_gelu_tanh import gelu_tanh, gelu_tanh_reference

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4
    torch.testing.assert_close(gelu_tanh(x), gelu_tanh_reference(x), rtol=1e-6, atol=1e-6)
    assert torch.equal(gelu_tanh_reference(x), F.gelu(x, approximate="tanh"))
    half = x.to(torch.bfloat16)
    assert gelu_tanh(half).dtype == torch.bfloat16


@pytest.mark.parametrize("recipe", ["tiny-wan2.1", "tiny-wan2.2-a14b"])
def test_through_the_pipeline_with_execution_proof(registry, recipe):
    from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
    from worldfoundry.bench.execution import prove_execution

    policy = RuntimePolicy(device="cpu", dtype=torch.float32, options={"accelerations": {NAME: True}})
    request = DiffusionRequest(prompt="a red ball", num_frames=5, height=32, width=32, num_inference_steps=2,
                               guidance_scale=5.0, seed=42, request_id="r1", output_type="latent")
    with NativeDiffusionPipeline.from_pretrained(recipe, policy=policy, registry=registry) as pipe:
        result = pipe.generate(request)
        denoiser = pipe.components.denoiser
        assert result.receipts["installed"]["names"] == [NAME]
        proof = prove_execution(result.receipts["installed"], result.receipts["plugins"])
        assert proof["executed"], proof["missing"]
        for label in denoiser.experts:
            assert result.receipts["plugins"][NAME][label]["claimed_not_executed"] == []
        json.dumps(denoiser.runtime_optimization_report())
        denoiser.uninstall()
        dense = pipe.generate(dataclasses.replace(request, request_id="dense")).latents
    torch.testing.assert_close(result.latents, dense, rtol=1e-4, atol=1e-4)
    assert not torch.equal(result.latents, dense)
