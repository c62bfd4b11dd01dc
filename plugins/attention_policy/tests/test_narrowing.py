"""The interception is entered around diffusers' dispatcher only (not over every op of the attention module), the
dispatcher global is put back by the last uninstall, and a processor that bypasses it is caught and re-routed."""

from __future__ import annotations

import torch
from diffusers.models import attention_dispatch
from diffusers.models.transformers import transformer_wan
from worldfoundry_attention_policy import narrowing

from worldfoundry import testing
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.attention.provider_dispatch import SdpaInterception

TEST_PROVIDER = "chunked_softmax"
SPEC = {"attention_policy": {"self": TEST_PROVIDER}}


def _policy_report(session) -> dict:
    return session.execution_report()["plugins"]["attention_policy"]["model"]


def _count_intercepted_ops(monkeypatch) -> list[int]:
    """How many torch functions pass through the interception (instrumentation of our own class)."""
    seen = [0]
    original = SdpaInterception.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        seen[0] += 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(SdpaInterception, "__torch_function__", counting)
    return seen


def test_only_the_dispatcher_runs_inside_the_interception(wan_case, registry, monkeypatch) -> None:
    original = transformer_wan.dispatch_attention_fn
    assert not narrowing.is_ours(original)
    session = install_diffusion_accelerations(wan_case.model, SPEC, registry=registry)
    assert narrowing.is_ours(transformer_wan.dispatch_attention_fn)
    seen = _count_intercepted_ops(monkeypatch)
    with request_scope(RequestContext("r1")):
        wan_case.run()
    report = _policy_report(session)
    assert report["interception"] == {"dispatcher_only": 2, "module_wide": 0}
    assert report["requests"]["r1"]["modules"] == {"blocks.0.attn1": {TEST_PROVIDER: 1},
                                                   "blocks.1.attn1": {TEST_PROVIDER: 1}}
    # the dispatcher's own few operations per call, not the projections, norms and reshapes of the module
    assert 0 < seen[0] <= 2 * 6, seen[0]
    session.uninstall()
    assert transformer_wan.dispatch_attention_fn is original
    assert narrowing.patched_modules() == {}


def test_the_pass_through_is_shared_and_released_by_the_last_uninstall(wan_case, wan_i2v, registry) -> None:
    original = transformer_wan.dispatch_attention_fn
    first, second = wan_case, wan_i2v
    s1 = install_diffusion_accelerations(first.model, SPEC, registry=registry)
    s2 = install_diffusion_accelerations(second.model, SPEC, registry=registry)
    assert narrowing.patched_modules() == {transformer_wan.__name__: 2}
    s1.uninstall()
    assert narrowing.is_ours(transformer_wan.dispatch_attention_fn)  # still needed by the second model
    with request_scope(RequestContext("r2")):
        second.run()
    assert _policy_report(s2)["requests"]["r2"]["counters"] == {TEST_PROVIDER: 2}
    s2.uninstall()
    assert transformer_wan.dispatch_attention_fn is original


def test_outside_a_routed_call_the_pass_through_calls_the_dispatcher_unchanged(wan_case, registry) -> None:
    dense = wan_case.run()
    session = install_diffusion_accelerations(wan_case.model, SPEC, registry=registry)
    q = torch.randn(1, 8, 2, 16)
    direct = attention_dispatch.dispatch_attention_fn(q, q, q)
    assert torch.equal(transformer_wan.dispatch_attention_fn(q, q, q), direct)  # nothing pending: plain dispatch
    session.uninstall()
    assert torch.equal(wan_case.run(), dense)


def test_another_model_compiles_through_the_pass_through(wan_case, registry) -> None:
    """A second instance compiled (full graph) while the first holds a policy: the pass-through is transparent to
    dynamo, and the compiled output equals that instance's eager output."""
    other = type(wan_case)(testing.tiny_wan(1, weight_scale=None), False)
    expected = other.run()
    session = install_diffusion_accelerations(wan_case.model, SPEC, registry=registry)
    assert narrowing.is_ours(transformer_wan.dispatch_attention_fn)
    torch._dynamo.reset()
    other.model.compile_repeated_blocks(fullgraph=True, backend="eager")
    try:
        assert torch.equal(other.run(), expected)
    finally:
        torch._dynamo.reset()
        session.uninstall()


class _BypassingProcessor(transformer_wan.WanAttnProcessor):
    """Says it dispatches through transformer_wan's global but calls the dispatcher module directly."""

    dispatch_namespace = transformer_wan

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        k = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        out = attention_dispatch.dispatch_attention_fn(q, k, v).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def test_a_processor_that_bypasses_the_global_is_caught_and_routed_module_wide(wan_case, registry) -> None:
    session = install_diffusion_accelerations(wan_case.model, SPEC, registry=registry)
    attn = wan_case.model.blocks[0].attn1
    attn.processor = _BypassingProcessor()  # a user change after install
    try:
        with request_scope(RequestContext("r1")):
            wan_case.run()
        r1 = _policy_report(session)["requests"]["r1"]
        assert r1["fallbacks"] == {f"self: {narrowing.REASON_NOT_REACHED}": 1}
        assert r1["modules"]["blocks.1.attn1"] == {TEST_PROVIDER: 1}
        with request_scope(RequestContext("r2")):
            wan_case.run()
        r2 = _policy_report(session)["requests"]["r2"]
        assert r2["modules"]["blocks.0.attn1"] == {TEST_PROVIDER: 1} and r2["fallbacks"] == {}
        assert _policy_report(session)["interception"]["module_wide"] == 1
    finally:
        narrowing._UNREACHABLE.discard(_BypassingProcessor)
        attn.processor = transformer_wan.WanAttnProcessor()
        session.uninstall()


def test_block_fusions_processor_is_intercepted_at_its_dispatcher_too(wan_case, registry) -> None:
    """``wan_block_fusion`` replaces the self-attention processor; it names transformer_wan as its dispatch module."""
    from worldfoundry_block_fusion import wan_plugin
    from worldfoundry_block_fusion.options import WanOptions

    registry.register("wan_block_fusion", wan_plugin.prepare, options=WanOptions)
    alone = install_diffusion_accelerations(wan_case.model, SPEC, registry=registry)
    with request_scope(RequestContext("alone")):
        reference = wan_case.run()
    alone.uninstall()
    fusion = {"min_tokens": 0, "kernel_compile": "blocking"}  # the fused processor runs from the first call
    session = install_diffusion_accelerations(wan_case.model, {**SPEC, "wan_block_fusion": fusion}, registry=registry)
    assert type(wan_case.model.blocks[0].attn1.processor).__name__ == "WanFusedSelfAttnProcessor"
    with request_scope(RequestContext("r1")):
        out = wan_case.run()
    report = _policy_report(session)
    assert report["interception"] == {"dispatcher_only": 2, "module_wide": 0}
    assert report["requests"]["r1"]["counters"] == {TEST_PROVIDER: 2}
    assert torch.equal(out, reference)  # the fused chains are bitwise; the provider call is the same
    session.uninstall()
    assert not narrowing.is_ours(transformer_wan.dispatch_attention_fn)
