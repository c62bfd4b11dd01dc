"""Installed ``svdquant`` on the CPU: receipts (reference backend, visibly), numerics vs dense, exact restore
(both ``keep_original`` modes), inference-view refusals, binding to the weights, conflicts, busy refusal."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
from worldfoundry_selective_fp8.plugin import prepare as prepare_fp8
from worldfoundry_svdquant.plugin import prepare

from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.quantization.parameter_digest import digest_computations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import (
    AccelerationConflictError,
    AccelerationRefusedError,
    ArtifactMismatchError,
    InferenceViewError,
    ModelBusyError,
)

POLICY = RuntimePolicy()


def registry() -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("svdquant", prepare)
    reg.register("selective_fp8", prepare_fp8)
    return reg


def install(model, artifact, **options):
    return install_diffusion_accelerations(model, {"svdquant": {"artifact": str(artifact), **options}}, POLICY,
                                           registry=registry())


def in_request(kit, model, request_id="r1"):
    with request_scope(RequestContext(request_id, branch="cond", step_index=0)):
        return kit.run_wan(model)


def test_cpu_runs_the_w4a8_reference_visibly_and_stays_close_to_dense(kit, wan, artifact):
    dense = kit.run_wan(wan)
    session = install(wan, artifact)
    out = in_request(kit, wan)
    record = session.execution_report()["plugins"]["svdquant"]["model"]["requests"]["r1"]
    assert record["modules"] == {p: {"reference": 1} for p in kit.WAN_FFN_PATHS}
    assert record["fallbacks"] == {} and record["claimed_not_executed"] == []
    assert record["counters"]["backend_reason: cpu device"] == 4
    # stated tolerance for these random weights (rank 16, group 64, INT8 activations): relative L2 < 5 %
    assert float((out - dense).norm() / dense.norm()) < 0.05
    session.uninstall()


def test_install_receipt_claims_and_memory(kit, wan, artifact):
    session = install(wan, artifact, keep_original="cpu")
    plugin = session.receipt.to_json()["plugins"][0]
    assert plugin["exact"] is False and session.receipt.execution_verified is False
    assert set(plugin["claims"]) == set(kit.WAN_FFN_PATHS) | {"role:quantization", "role:weight_view"}
    section = session.execution_report()["plugins"]["svdquant"]["model"]["svdquant"]
    dense = 4 * 64 * 128 * 4
    assert section["memory"]["dense_weight_bytes"] == dense and section["memory"]["dense_bytes_on_host"] == dense
    assert section["artifact"]["format"] == "worldfoundry-svdquant-v1" and section["artifact"]["rank"] == 16
    assert section["keep_original"] == "cpu"
    session.uninstall()


@pytest.mark.parametrize("keep", ["device", "cpu"])
def test_uninstall_restores_state_dict_structure_and_output_bitwise(kit, wan, artifact, keep):
    before = kit.fingerprint(wan)
    linear = wan.blocks[0].ffn.net[2]
    signature = inspect.signature(linear.forward)
    weight = linear.weight
    session = install(wan, artifact, keep_original=keep)
    assert inspect.signature(linear.forward) == signature
    handle = session.handles("svdquant")["model"]
    if keep == "cpu":
        assert handle.runtime.targets["blocks.0.ffn.net.2"].host_copy is not None
    in_request(kit, wan)
    session.uninstall()
    session.uninstall()  # idempotent
    assert linear.weight is weight and not handle.runtime.targets
    kit.assert_same(before, kit.fingerprint(wan))


GUARDED = {
    "state_dict": lambda m: m.state_dict(),
    "load_state_dict": lambda m: m.load_state_dict({}),
    "to dtype": lambda m: m.to(torch.bfloat16),
    "cpu": lambda m: m.cpu(),
    "train": lambda m: m.train(),
    "linear state_dict": lambda m: m.blocks[1].ffn.net[2].state_dict(),
    "assign weight": lambda m: setattr(m.blocks[0].ffn.net[0].proj, "weight", nn.Parameter(torch.zeros(128, 64))),
}


@pytest.mark.parametrize("call", list(GUARDED))
def test_inference_view_refusals_say_uninstall_first(kit, wan, artifact, call):
    session = install(wan, artifact)
    with pytest.raises(InferenceViewError, match="uninstall svdquant first"):
        GUARDED[call](wan)
    session.uninstall()
    GUARDED[call](wan) if call not in ("assign weight", "load_state_dict") else None


def test_weights_edited_in_place_are_refused_at_the_next_forward(kit, wan, artifact):
    session = install(wan, artifact)
    with torch.no_grad():
        wan.blocks[0].ffn.net[2].weight.mul_(1.0)
    with pytest.raises(InferenceViewError, match="edited in place"):
        kit.run_wan(wan)
    session.uninstall()


def test_artifact_of_other_weights_is_refused_before_any_change(kit, wan, artifact):
    with torch.no_grad():
        wan.blocks[1].ffn.net[0].proj.weight[0, 0] += 1.0
    before = kit.fingerprint(wan)
    with pytest.raises(ArtifactMismatchError, match=r"blocks\.1\.ffn\.net\.0\.proj\.weight SHA256 .* calibrate again"):
        install(wan, artifact)
    kit.assert_same(before, kit.fingerprint(wan))
    other = kit.build_wan(seed=3, dtype=torch.bfloat16)
    with pytest.raises(ArtifactMismatchError, match="other weights or dtype"):
        install(other, artifact)


def test_digests_are_not_recomputed_for_unchanged_weights(kit, wan, artifact):
    install(wan, artifact).uninstall()
    count = digest_computations()
    install(wan, artifact).uninstall()
    assert digest_computations() == count


def test_include_selects_part_of_the_artifact_with_original_names(kit, wan, artifact):
    session = install(wan, artifact, include=["blocks.0.ffn.0"])
    assert session.receipt.to_json()["plugins"][0]["claims"] == sorted(
        ["blocks.0.ffn.net.0.proj", "role:quantization", "role:weight_view"])
    session.uninstall()
    with pytest.raises(AccelerationRefusedError, match="has no entry for: blocks.0.attn1.to_q"):
        install(wan, artifact, include=["blocks.0.attn1.to_q"])


def test_pt_artifact_and_rtn_method(kit, wan, tmp_path):
    pt = kit.calibrate(wan, tmp_path / "svdquant.pt")
    rtn = kit.calibrate(wan, tmp_path / "rtn.json", method="rtn")
    for path in (pt, rtn):
        session = install(wan, path)
        in_request(kit, wan)
        session.uninstall()


def test_autograd_inputs_fall_back_with_keep_device_and_raise_with_keep_cpu(kit, wan, artifact):
    x = torch.randn(3, 64, requires_grad=True)
    session = install(wan, artifact)
    linear = wan.blocks[0].ffn.net[0].proj
    with request_scope(RequestContext("g")):
        linear(x).sum().backward()
    record = session.execution_report()["plugins"]["svdquant"]["model"]["requests"]["g"]
    assert record["fallbacks"] == {"autograd enabled": 1}
    session.uninstall()
    session = install(wan, artifact, keep_original="cpu")
    with pytest.raises(InferenceViewError, match="keep_original: cpu"):
        linear(x)
    session.uninstall()


@pytest.mark.parametrize("order", ["svdquant-first", "fp8-first"])
def test_conflicts_with_selective_fp8_on_the_same_linears(kit, wan, artifact, order):
    before = kit.fingerprint(wan)
    specs = {"svdquant": {"artifact": str(artifact)}, "selective_fp8": {"min_tokens": 1}}
    if order == "fp8-first":
        specs = dict(reversed(list(specs.items())))
    with pytest.raises(AccelerationConflictError) as info:
        install_diffusion_accelerations(wan, specs, POLICY, registry=registry())
    assert {info.value.first, info.value.second} == {"svdquant", "selective_fp8"}
    kit.assert_same(before, kit.fingerprint(wan))
    # different Linears still conflict through role:quantization
    with pytest.raises(AccelerationConflictError, match="role:quantization"):
        install_diffusion_accelerations(wan, {"svdquant": {"artifact": str(artifact), "include": ["blocks.0.ffn.0"]},
                                              "selective_fp8": {"include": ["blocks.1.attn1.to_q"], "min_tokens": 1}},
                                        POLICY, registry=registry())


def test_refused_while_a_request_runs(kit, wan, artifact):
    guard = attach_request_guard(wan)
    with guard.request("busy"):
        with pytest.raises(ModelBusyError):
            install(wan, artifact)
    install(wan, artifact).uninstall()
