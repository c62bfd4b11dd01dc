"""Installed ``selective_fp8`` on the CPU: dense fallbacks with receipts, inference-view guard, exact restore,
conflicts with other plugins (claims and roles, both spec orders) and refusal while busy."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from worldfoundry_selective_fp8.plugin import prepare

from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.handle import RecordedHandle
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.prepared import (
    ROLE_APPROXIMATE_ATTENTION,
    ROLE_FEATURE_CACHE,
    ROLE_OFFLOAD,
    ROLE_QUANTIZATION,
    ROLE_STATIC_KV_CACHE,
    PreparedAcceleration,
)
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.acceleration.session import get_session
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import AccelerationConflictError, InferenceViewError, ModelBusyError

POLICY = RuntimePolicy()
SPEC = {"selective_fp8": {"min_tokens": 1}}


class ClaimingPlugin:
    """A tiny plugin that claims the given module paths and roles; counts activations."""

    def __init__(self, name: str, claims: Callable[[nn.Module], set[str]]) -> None:
        self.name = name
        self.claims = claims
        self.activations = 0

    def __call__(self, model: nn.Module, options, policy) -> PreparedAcceleration:
        def activate() -> RecordedHandle:
            self.activations += 1
            return RecordedHandle(self.name, PatchRecorder(self.name))

        return PreparedAcceleration(self.name, frozenset(self.claims(model)), activate)


def registry(*others: ClaimingPlugin) -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("selective_fp8", prepare)
    for other in others:
        reg.register(other.name, other)
    return reg


def install(model: nn.Module, spec=None, reg=None):
    return install_diffusion_accelerations(model, spec or SPEC, POLICY, registry=reg or registry())


def forward_in_request(kit, model: nn.Module, request_id: str = "r1", dtype=torch.float32) -> torch.Tensor:
    with request_scope(RequestContext(request_id, branch="cond", step_index=0)):
        return kit.run_wan(model, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_runs_the_retained_dense_linears_and_records_each_fallback(kit, dtype):
    model = kit.build_wan(dtype=dtype)
    dense = kit.run_wan(model, dtype)
    session = install(model)
    out = forward_in_request(kit, model, dtype=dtype)
    assert torch.equal(out, dense)  # the fallback is the original operator, bitwise
    report = session.execution_report()["plugins"]["selective_fp8"]["model"]
    record = report["requests"]["r1"]
    assert record["fallbacks"] == {"cpu device": 4}
    assert record["module_fallbacks"] == {p: {"cpu device": 1} for p in kit.WAN_FFN_PATHS}
    assert record["modules"] == {} and record["counters"].get("fp8_gemm", 0) == 0
    assert record["counters"].get("fp8_gelu_fused", 0) == 0
    # never reports FP8 speed for them (the fused FFNs are claimed too, and never ran fused)
    assert sorted(record["claimed_not_executed"]) == sorted([*kit.WAN_FFN_PATHS, "blocks.0.ffn", "blocks.1.ffn"])
    session.uninstall()


def test_install_receipt_and_memory_report(kit, wan):
    session = install(wan)
    plugin = session.receipt.to_json()["plugins"][0]
    assert plugin["exact"] is False and session.receipt.execution_verified is False
    assert set(plugin["claims"]) == set(kit.WAN_FFN_PATHS) | {"blocks.0.ffn", "blocks.1.ffn", ROLE_QUANTIZATION,
                                                               "role:weight_view"}
    assert any("2 FFN(s) run GELU + the down projection's activation quantization as one kernel" in n
               for n in plugin["notes"])
    assert any("does not save memory" in n for n in plugin["notes"])
    section = session.execution_report()["plugins"]["selective_fp8"]["model"]["selective_fp8"]
    assert section["modules"] == kit.WAN_FFN_PATHS
    # 4 Linears of 64x128: FP8 bytes = 4*8192, scales = 4 bytes per output row, dense kept (fp32: 4*32768)
    assert section["memory"] == {"dense_weight_bytes_retained": 4 * 64 * 128 * 4, "fp8_weight_bytes": 4 * 64 * 128,
                                 "scale_bytes": 4 * (128 + 64 + 128 + 64), "extra_bytes": 4 * 64 * 128 + 1536}
    assert section["activation_clipping"]["elements_total"] == 0
    assert section["fused_producer"]["ffns"] == ["blocks.0.ffn", "blocks.1.ffn"]
    assert section["fused_producer"]["not_fused"] == {} and section["fused_producer"]["kind"] == "fp8_gelu_fused"
    session.uninstall()


def test_uninstall_restores_state_dict_structure_and_output_bitwise(kit, wan):
    before = kit.fingerprint(wan)
    signature = inspect.signature(wan.blocks[0].ffn.net[2].forward)
    session = install(wan)
    assert "forward" in wan.blocks[0].ffn.net[2].__dict__
    assert inspect.signature(wan.blocks[0].ffn.net[2].forward) == signature
    forward_in_request(kit, wan)
    handle = session.handles("selective_fp8")["model"]
    session.uninstall()
    session.uninstall()  # idempotent
    assert not handle.runtime.targets  # derived FP8 tensors dropped
    assert get_session(wan) is None
    kit.assert_same(before, kit.fingerprint(wan))


GUARDED_CALLS = {
    "state_dict": lambda m: m.state_dict(),
    "load_state_dict": lambda m: m.load_state_dict({}),
    "to dtype": lambda m: m.to(torch.bfloat16),
    "to device": lambda m: m.to("cpu"),
    "half": lambda m: m.half(),
    "float": lambda m: m.float(),
    "cpu": lambda m: m.cpu(),
    "train": lambda m: m.train(),
    "block train": lambda m: m.blocks[0].train(),
    "linear state_dict": lambda m: m.blocks[1].ffn.net[2].state_dict(),
    "assign weight": lambda m: setattr(m.blocks[0].ffn.net[0].proj, "weight", nn.Parameter(torch.zeros(128, 64))),
}


@pytest.mark.parametrize("call", list(GUARDED_CALLS))
def test_inference_view_refusals_while_active(wan, call):
    keys = list(wan.state_dict())
    session = install(wan)
    with pytest.raises(InferenceViewError, match="uninstall selective_fp8 first"):
        GUARDED_CALLS[call](wan)
    wan.eval()  # allowed
    session.uninstall()
    if call not in ("load_state_dict", "assign weight"):
        GUARDED_CALLS[call](wan)  # allowed again once uninstalled
    assert list(wan.state_dict()) == keys


def test_in_place_weight_edit_is_refused_at_the_next_forward(kit, wan):
    session = install(wan)
    with torch.no_grad():
        wan.blocks[1].ffn.net[2].weight.add_(1.0)
    with pytest.raises(InferenceViewError, match="blocks.1.ffn.net.2.weight was edited in place"):
        kit.run_wan(wan)
    session.uninstall()
    kit.run_wan(wan)  # the edited dense model runs again once the view is gone


def test_hooks_on_parent_modules_keep_running(kit, wan):
    calls = []
    wan.blocks[0].register_forward_pre_hook(lambda m, a: calls.append("block"))
    wan.blocks[0].ffn.register_forward_hook(lambda m, a, o: calls.append("ffn"))
    session = install(wan)
    kit.run_wan(wan)
    assert calls == ["block", "ffn"]
    session.uninstall()


def _kv_claims(model: nn.Module) -> set[str]:
    return {"blocks.0.attn2.to_k", "blocks.0.attn2.to_v"}


CONFLICTS = {
    "same K/V projections": (_kv_claims, "blocks.0.attn2.to_k"),
    "other quantization": (lambda m: {"blocks.1.attn1.to_q", ROLE_QUANTIZATION}, ROLE_QUANTIZATION),
    "feature cache": (lambda m: {"<root>", ROLE_FEATURE_CACHE}, ROLE_FEATURE_CACHE),
    "static kv cache": (lambda m: {ROLE_STATIC_KV_CACHE}, ROLE_STATIC_KV_CACHE),
    "offload": (lambda m: {ROLE_OFFLOAD}, ROLE_OFFLOAD),
    "approximate attention": (lambda m: {ROLE_APPROXIMATE_ATTENTION}, ROLE_APPROXIMATE_ATTENTION),
}


@pytest.mark.parametrize("order", ["fp8 first", "other first"])
@pytest.mark.parametrize("case", list(CONFLICTS))
def test_conflicts_are_found_before_any_activation(kit, case, order):
    claims, resource = CONFLICTS[case]
    other = ClaimingPlugin("other_plugin", claims)
    fp8 = {"include": ["blocks.*.attn2.to_k", "blocks.*.attn2.to_v", "blocks.*.ffn.net.2"], "min_tokens": 1}
    spec = {"selective_fp8": fp8, "other_plugin": {}}
    if order == "other first":
        spec = {"other_plugin": {}, "selective_fp8": fp8}
    model = kit.build_wan()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AccelerationConflictError) as info:
        install(model, spec, registry(other))
    message = str(info.value)
    assert "selective_fp8" in message and "other_plugin" in message and resource in message
    assert other.activations == 0 and get_session(model) is None
    assert "forward" not in model.blocks[0].attn2.to_k.__dict__
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_install_is_refused_while_a_request_is_active(wan):
    guard = attach_request_guard(wan)
    with guard.request("busy"), pytest.raises(ModelBusyError, match="busy"):
        install(wan)
    assert get_session(wan) is None


def test_end_request_notes_the_clipping_count(kit, wan):
    session = install(wan)
    guard = attach_request_guard(wan)
    with guard.request("r2"):
        forward_in_request(kit, wan, "r2")
    record = session.execution_report()["plugins"]["selective_fp8"]["model"]["requests"]["r2"]
    assert record["notes"]["activation_clipped_elements"] == 0
    session.uninstall()


def test_routed_experts_get_one_activation_each(kit):
    high, low = kit.build_wan(seed=0), kit.build_wan(seed=1)
    dense = {"high": kit.run_wan(high), "low": kit.run_wan(low)}
    session = install_diffusion_accelerations({"high": high, "low": low}, SPEC, POLICY, registry=registry())
    handles = session.handles("selective_fp8")
    assert set(handles) == {"high", "low"} and handles["high"] is not handles["low"]
    assert set(session.receipt.plugins[0].claims) >= {f"{e}/{p}" for e in ("high", "low") for p in kit.WAN_FFN_PATHS}
    with request_scope(RequestContext("r1", expert="high")):
        kit.run_wan(high)
    report = session.execution_report()["plugins"]["selective_fp8"]
    assert report["high"]["requests"]["r1"]["fallbacks"] == {"cpu device": 4}
    assert "r1" not in report["low"]["requests"]
    with pytest.raises(InferenceViewError, match="uninstall selective_fp8 first"):
        low.state_dict()
    session.uninstall()
    assert torch.equal(kit.run_wan(high), dense["high"]) and torch.equal(kit.run_wan(low), dense["low"])
