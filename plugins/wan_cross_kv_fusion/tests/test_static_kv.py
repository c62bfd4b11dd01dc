"""Static text K/V per request: bitwise equal to dense, steps - 1 hits per branch, exact invalidation."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.prepared import ROLE_STATIC_KV_CACHE

SPEC = {"wan_cross_kv_fusion": {"min_tokens": 0}}
KV_PATHS = [f"blocks.{i}.attn2.{p}" for i in (0, 1) for p in ("to_k", "to_v")]


def _equal_lists(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_cache_hits_per_branch_and_bitwise_outputs(wan, registry, record) -> None:  # noqa: ANN001
    steps = 4
    dense = wan.dense_outputs(steps)
    state = {k: v.clone() for k, v in wan.model.state_dict().items()}
    signature = inspect.signature(wan.model.blocks[0].attn2.to_k.forward)
    session = install_diffusion_accelerations(wan.model, SPEC, registry=registry)
    plugin = session.receipt.plugins[0]
    assert plugin.exact is True
    norms = [f"blocks.{i}.attn2.norm_k" for i in (0, 1)]
    assert set(plugin.claims) == set(KV_PATHS) | set(norms) | {ROLE_STATIC_KV_CACHE}
    assert inspect.signature(wan.model.blocks[0].attn2.to_k.forward) == signature
    handle = session.handles("wan_cross_kv_fusion")["model"]

    assert _equal_lists(wan.run_request("r1", steps), dense)
    rec = record(session, "r1")
    sites = 2
    assert rec["counters"]["kv_cache_hit.cond"] == (steps - 1) * sites
    assert rec["counters"]["kv_cache_hit.uncond"] == (steps - 1) * sites
    assert rec["counters"]["kv_cache_miss.cond"] == sites and rec["counters"]["kv_cache_miss.uncond"] == sites
    for path in KV_PATHS:
        assert rec["modules"][path]["cached_text_kv"] == 2 * (steps - 1)
        assert rec["modules"][path].get("packed_text_kv", 0) + rec["module_fallbacks"].get(path, {}).get(
            "fused_gemm_not_bitwise", 0) == 2
    for path in norms:  # the normalised key is cached with K/V
        assert rec["modules"][path] == {"computed_text_kv_norm": 2, "cached_text_kv_norm": 2 * (steps - 1)}
    assert rec["claimed_not_executed"] == []
    assert rec["finished"] is True and rec["notes"]["kv_cache_entries_dropped"] == 2 * sites
    assert handle.cache.entries() == 0  # dropped at request end
    assert list(wan.model.state_dict()) == list(state)
    assert all(torch.equal(state[k], v) for k, v in wan.model.state_dict().items())

    # a second request recomputes (nothing carried over) and matches again
    assert _equal_lists(wan.run_request("r2", 2), dense[:4])
    assert record(session, "r2")["counters"]["kv_cache_miss"] == 2 * sites

    session.uninstall()
    assert handle.groups == {} and handle.cache.entries() == 0
    assert "forward" not in wan.model.blocks[0].attn2.to_k.__dict__
    assert not wan.model._forward_pre_hooks or all(
        getattr(h, "__self__", None) is not handle for h in wan.model._forward_pre_hooks.values())
    assert all(torch.equal(state[k], v) for k, v in wan.model.state_dict().items())
    assert _equal_lists(wan.dense_outputs(2), dense[:4])


def test_prompt_changes_invalidate(wan, registry, record) -> None:  # noqa: ANN001
    session = install_diffusion_accelerations(wan.model, SPEC, registry=registry)
    original = wan.prompts["cond"]

    def change(step: int) -> None:
        if step == 1:
            wan.prompts["cond"].mul_(1.0)  # same values, new version
        elif step == 2:
            wan.prompts["cond"].mul_(2.0)  # in-place edit of the prompt embedding
        elif step == 3:
            wan.prompts["cond"] = wan.prompts["cond"].clone()  # a new tensor object

    outputs = wan.run_request("r", 4, branches=("cond",), before_step=change)
    rec = record(session, "r")
    assert rec["counters"]["kv_cache_miss.cond"] == 4 * 2  # every step recomputed, both blocks
    assert rec["counters"]["kv_cache_invalidated"] == 3 * 2
    assert rec["counters"].get("kv_cache_hit", 0) == 0
    session.uninstall()
    assert torch.equal(outputs[2], wan.call(2, "cond"))  # the doubled prompt, computed densely
    assert not torch.equal(outputs[2], wan.call(2, "cond", original.div(2.0)))
    assert torch.equal(outputs[3], wan.call(3, "cond"))


def test_weight_changes_invalidate_and_refresh_the_packed_copy(wan, registry, record, builders) -> None:  # noqa: ANN001
    session = install_diffusion_accelerations(wan.model, SPEC, registry=registry)
    handle = session.handles("wan_cross_kv_fusion")["model"]
    attn = wan.model.blocks[0].attn2

    def change(step: int) -> None:
        with torch.no_grad():
            if step == 1:
                attn.to_k.weight.add_(0.5)  # in place (version counter)
            elif step == 2:
                attn.to_v.weight = nn.Parameter(attn.to_v.weight.detach() * 0.5)  # Parameter assignment
            elif step == 3:
                wan.model.condition_embedder.text_embedder.linear_1.bias.add_(1.0)  # what feeds the context

    outputs = wan.run_request("r", 4, branches=("cond",), before_step=change)
    rec = record(session, "r")
    assert rec["counters"]["kv_cache_invalidated"] == 1 + 1 + 2  # block 0 twice, then both blocks
    assert rec["counters"]["kv_cache_hit"] == 1 + 1  # block 1 at steps 1 and 2
    assert handle.groups["blocks.0.attn2:text_kv"].pack.builds == 3
    reference = builders()
    reference.model.load_state_dict(wan.model.state_dict())
    session.uninstall()
    assert torch.equal(outputs[3], reference.call(3, "cond"))


def test_dense_bypass_below_min_tokens(wan, registry, record) -> None:  # noqa: ANN001
    dense = wan.dense_outputs(2)
    session = install_diffusion_accelerations(wan.model, {"wan_cross_kv_fusion": {"min_tokens": 25}},
                                              registry=registry)
    assert _equal_lists(wan.run_request("r", 2), dense)  # 24 text tokens < 25
    rec = record(session, "r")
    assert rec["counters"]["dense_bypass"] == 2 * 2 * 2
    assert rec["module_fallbacks"]["blocks.0.attn2.to_k"] == {"below_min_tokens": 4}
    assert rec["module_fallbacks"]["blocks.0.attn2.to_v"] == {"below_min_tokens": 4}
    assert rec["counters"].get("kv_cache_hit", 0) == 0 and rec["modules"] == {}


def test_calls_outside_a_request_are_packed_but_not_cached(wan, registry) -> None:  # noqa: ANN001
    dense = wan.call(0, "cond")
    session = install_diffusion_accelerations(wan.model, SPEC, registry=registry)
    assert torch.equal(wan.call(0, "cond"), dense)
    with request_scope(RequestContext("scoped", "cond", 0)):
        assert torch.equal(wan.call(0, "cond"), dense)
        assert torch.equal(wan.call(0, "cond"), dense)
    report = session.execution_report()["plugins"]["wan_cross_kv_fusion"]["model"]["requests"]
    assert report["<no-request>"]["counters"]["kv_cache_unscoped"] == 2
    assert report["scoped"]["counters"]["kv_cache_hit"] == 2
    session.uninstall()  # entries of a request never ended are dropped too
    assert session.handles("wan_cross_kv_fusion") == {}


def test_image_kv_is_packed_and_cached_with_include_image(wan_i2v, registry, record) -> None:  # noqa: ANN001
    steps = 3
    dense = wan_i2v.dense_outputs(steps)
    spec = {"wan_cross_kv_fusion": {"min_tokens": 0, "include_image": True}}
    session = install_diffusion_accelerations(wan_i2v.model, spec, registry=registry)
    claims = set(session.receipt.plugins[0].claims)
    assert {"blocks.0.attn2.add_k_proj", "blocks.1.attn2.add_v_proj"} <= claims
    assert _equal_lists(wan_i2v.run_request("r", steps), dense)
    rec = record(session, "r")
    assert rec["modules"]["blocks.0.attn2.add_k_proj"]["cached_image_kv"] == 2 * (steps - 1)
    assert rec["modules"]["blocks.0.attn2.to_v"]["cached_text_kv"] == 2 * (steps - 1)
    assert rec["counters"]["kv_cache_hit.cond"] == (steps - 1) * 2 * 2  # 2 blocks x (text, image)
    report = session.execution_report()["plugins"]["wan_cross_kv_fusion"]["model"]
    assert report["derived_weight_bytes"] > 0
    session.uninstall()


def test_inference_mode_conditioning_is_tracked_by_content(wan, registry, record) -> None:  # noqa: ANN001
    with torch.inference_mode():
        frozen = wan.prompts["cond"].clone()
    wan.prompts["cond"] = frozen
    dense = wan.dense_outputs(3, branches=("cond",))
    session = install_diffusion_accelerations(wan.model, SPEC, registry=registry)

    def change(step: int) -> None:
        if step == 2:
            with torch.inference_mode():
                frozen.mul_(3.0)

    outputs = wan.run_request("r", 3, branches=("cond",), before_step=change)
    rec = record(session, "r")
    assert rec["counters"]["kv_cache_hit"] == 2 and rec["counters"]["kv_cache_invalidated"] == 2
    assert torch.equal(outputs[0], dense[0]) and torch.equal(outputs[1], dense[1])
    session.uninstall()
    assert torch.equal(outputs[2], wan.call(2, "cond"))
