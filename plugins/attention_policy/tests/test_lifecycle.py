"""Install, per-call routing and receipts, exact restore, busy refusal, conflicts — with the test distribution's
``chunked_softmax`` provider found through the ``worldfoundry.attention_providers`` entry point."""

from __future__ import annotations

from worldfoundry.core.acceleration.guard import attach_request_guard

import inspect

import pytest
import torch

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import get_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.prepared import ROLE_APPROXIMATE_ATTENTION
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.attention.provider_dispatch import BELOW_MIN_TOKENS, OUTSIDE_STEP_RANGE, STEP_UNKNOWN
from worldfoundry.errors import AccelerationConflictError, ModelBusyError

FLASH_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"  # PyTorch's default SDPA op on CPU
TEST_PROVIDER = "chunked_softmax"
SELF_PATHS = ("blocks.0.attn1", "blocks.1.attn1")
CROSS_PATHS = ("blocks.0.attn2", "blocks.1.attn2")
#: relative tolerance of an exact-equivalent provider's forward against the dense fp32 forward
RTOL = 1e-4


def _report(session, request_id: str) -> dict:
    return session.execution_report()["plugins"]["attention_policy"]["model"]["requests"][request_id]


def test_self_attention_runs_on_the_provider_and_is_counted(wan_case, registry, op_recorder) -> None:
    dense = wan_case.run()
    state = {k: v.clone() for k, v in wan_case.model.state_dict().items()}
    signature = inspect.signature(wan_case.model.blocks[0].attn1.forward)
    session = install_diffusion_accelerations(wan_case.model, {"attention_policy": {"self": TEST_PROVIDER}},
                                              registry=registry)
    record = session.receipt.plugins[0]
    assert set(record.claims) == set(SELF_PATHS) and record.exact is False
    assert any("same accuracy class" in note for note in record.notes)
    assert inspect.signature(wan_case.model.blocks[0].attn1.forward) == signature
    with op_recorder() as ops, request_scope(RequestContext("r1")):
        out = wan_case.run()
    assert ops.ops.count(FLASH_CPU) == 2  # the two cross-attention calls only
    torch.testing.assert_close(out, dense, rtol=RTOL, atol=1e-5)
    r1 = _report(session, "r1")
    assert r1["modules"] == {p: {TEST_PROVIDER: 1} for p in SELF_PATHS}
    assert r1["counters"] == {TEST_PROVIDER: 2} and r1["fallbacks"] == {} and r1["claimed_not_executed"] == []
    routes = session.execution_report()["plugins"]["attention_policy"]["model"]["routes"]
    assert routes["self"]["provider"] == TEST_PROVIDER and routes["self"]["numerics"] == "exact_equivalent"

    session.uninstall()
    assert all("forward" not in wan_case.model.get_submodule(p).__dict__ for p in SELF_PATHS)
    assert all(torch.equal(v, state[k]) for k, v in wan_case.model.state_dict().items())
    with op_recorder() as ops:
        assert torch.equal(wan_case.run(), dense)
    assert ops.ops.count(FLASH_CPU) == 4


def test_min_tokens_keeps_short_calls_on_sdpa_and_says_why(wan_case, registry) -> None:
    dense = wan_case.run()
    # self-attention has 2*4*4 = 32 query tokens, cross-attention 32 queries x 24 text tokens
    spec = {"attention_policy": {"self": {"backend": TEST_PROVIDER, "min_tokens": 33},
                                 "text_cross": {"backend": TEST_PROVIDER, "min_tokens": 24}}}
    session = install_diffusion_accelerations(wan_case.model, spec, registry=registry)
    with request_scope(RequestContext("r1")):
        out = wan_case.run()
    r1 = _report(session, "r1")
    assert r1["modules"] == {p: {TEST_PROVIDER: 1} for p in CROSS_PATHS}
    assert r1["module_fallbacks"] == {p: {f"self: {BELOW_MIN_TOKENS}": 1} for p in SELF_PATHS}
    assert r1["counters"]["dense_fallback"] == 2 and r1["claimed_not_executed"] == list(SELF_PATHS)
    torch.testing.assert_close(out, dense, rtol=RTOL, atol=1e-5)
    session.uninstall()


def test_dense_first_and_last_steps(wan_case, registry) -> None:
    spec = {"attention_policy": {"self": {"backend": TEST_PROVIDER, "dense_first_steps": 1, "dense_last_steps": 1}}}
    session = install_diffusion_accelerations(wan_case.model, spec, registry=registry)
    guard = get_request_guard(wan_case.model)
    with guard.request("r1"):
        for step in range(4):
            with request_scope(RequestContext("r1", step_index=step, num_steps=4)):
                wan_case.run(step)
    wan_case.run()  # outside a request: the step is unknown, so the step range cannot be honoured
    r1 = _report(session, "r1")
    assert r1["counters"][TEST_PROVIDER] == 4 and r1["counters"]["dense_fallback"] == 4
    assert r1["fallbacks"] == {f"self: {OUTSIDE_STEP_RANGE}": 4} and r1["finished"] is True
    assert _report(session, "<no-request>")["fallbacks"] == {f"self: {STEP_UNKNOWN}": 2}
    session.uninstall()


def test_image_and_text_cross_attention_are_routed_by_call_order(wan_i2v, registry, op_recorder) -> None:
    dense = wan_i2v.run()
    session = install_diffusion_accelerations(
        wan_i2v.model, {"attention_policy": {"image_cross": TEST_PROVIDER}}, registry=registry)
    assert set(session.receipt.plugins[0].claims) == set(CROSS_PATHS)
    with op_recorder() as ops, request_scope(RequestContext("r1")):
        out = wan_i2v.run()
    assert ops.ops.count(FLASH_CPU) == 4  # 2 self + 2 text cross stay on SDPA; the 2 image calls do not
    assert _report(session, "r1")["modules"] == {p: {TEST_PROVIDER: 1} for p in CROSS_PATHS}
    torch.testing.assert_close(out, dense, rtol=RTOL, atol=1e-5)
    session.uninstall()
    assert torch.equal(wan_i2v.run(), dense)


def test_cross_shorthand_on_a_text_only_model_skips_image_cross(wan_case, registry) -> None:
    session = install_diffusion_accelerations(wan_case.model, {"attention_policy": {"cross": TEST_PROVIDER}},
                                              registry=registry)
    notes = session.receipt.plugins[0].notes
    assert any(n.startswith("image_cross: this model has no image_cross attention") for n in notes)
    with request_scope(RequestContext("r1")):
        wan_case.run()
    assert _report(session, "r1")["counters"] == {TEST_PROVIDER: 2}
    session.uninstall()


def test_refused_while_a_request_runs(wan_case, registry) -> None:
    guard = attach_request_guard(wan_case.model)  # as the loader does: the guard outlives the session
    session = install_diffusion_accelerations(wan_case.model, {"attention_policy": {"self": TEST_PROVIDER}},
                                              registry=registry)
    with guard.request("busy"):
        with pytest.raises(ModelBusyError):
            session.uninstall()
    session.uninstall()
    with guard.request("busy2"):
        with pytest.raises(ModelBusyError):
            install_diffusion_accelerations(wan_case.model, {"attention_policy": {"self": TEST_PROVIDER}},
                                            registry=registry)


def test_conflicts_with_optimized_mha_sdpa_backend_on_the_same_modules(wan_case, providers) -> None:
    registry = AccelerationRegistry(allowlist=["attention_policy", "optimized_mha"])
    spec = {"optimized_mha": {"self": {"fusion": "none", "sdpa_backend": "math"}},
            "attention_policy": {"self": TEST_PROVIDER}}
    dense = wan_case.run()
    with pytest.raises(AccelerationConflictError) as info:
        install_diffusion_accelerations(wan_case.model, spec, registry=registry)
    message = str(info.value)
    assert "'attention_policy'" in message and "'optimized_mha'" in message and "blocks.0.attn1" in message
    assert "_worldfoundry_accelerations" not in wan_case.model.__dict__
    assert torch.equal(wan_case.run(), dense)


def test_composes_with_optimized_mha_fusion(wan_case, providers) -> None:
    registry = AccelerationRegistry(allowlist=["attention_policy", "optimized_mha"])
    dense = wan_case.run()
    spec = {"optimized_mha": {"self": {"fusion": "qkv"}, "cross": {"fusion": "kv"}},
            "attention_policy": {"self": TEST_PROVIDER}}
    session = install_diffusion_accelerations(wan_case.model, spec, registry=registry)
    with request_scope(RequestContext("r1")):
        out = wan_case.run()
    torch.testing.assert_close(out, dense, rtol=RTOL, atol=1e-5)
    plugins = session.execution_report()["plugins"]
    assert plugins["attention_policy"]["model"]["requests"]["r1"]["counters"] == {TEST_PROVIDER: 2}
    assert plugins["optimized_mha"]["model"]["requests"]["r1"]["claimed_not_executed"] == []
    session.uninstall()
    assert torch.equal(wan_case.run(), dense)


def test_an_approximate_provider_takes_the_approximate_attention_role(wan_case, providers, make_registry) -> None:
    import dataclasses

    approximate = dataclasses.replace(providers.get(TEST_PROVIDER), name="chunked_marked_approximate",
                                      numerics="approximate")
    providers.register(approximate)
    session = install_diffusion_accelerations(
        wan_case.model, {"attention_policy": {"self": approximate.name}}, registry=make_registry(providers))
    record = session.receipt.plugins[0]
    assert ROLE_APPROXIMATE_ATTENTION in record.claims and record.exact is False
    assert any("approximate: judged on quality" in note for note in record.notes)
    session.uninstall()
