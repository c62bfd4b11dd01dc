"""The per-forward fast path: ``pack=False`` (no derived weights), contiguous cached K/V, concurrent forwards."""

from __future__ import annotations

import threading

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations

KV_PATHS = [f"blocks.{i}.attn2.{p}" for i in (0, 1) for p in ("to_k", "to_v")]


def test_pack_false_adds_no_weights_and_is_bitwise(wan, registry, record) -> None:  # noqa: ANN001
    steps = 3
    dense = wan.dense_outputs(steps)
    session = install_diffusion_accelerations(wan.model, {"wan_cross_kv_fusion": {"min_tokens": 0, "pack": False}},
                                              registry=registry)
    assert "0 bytes added" in " ".join(session.receipt.plugins[0].notes)
    outputs = wan.run_request("r", steps)
    assert all(torch.equal(a, b) for a, b in zip(outputs, dense, strict=True))
    rec = record(session, "r")
    for path in KV_PATHS:
        assert rec["modules"][path] == {"separate_text_kv": 2, "cached_text_kv": 2 * (steps - 1)}
    assert rec["module_fallbacks"] == {} and rec["claimed_not_executed"] == []
    assert rec["counters"]["kv_cache_hit.cond"] == (steps - 1) * 2
    report = session.execution_report()["plugins"]["wan_cross_kv_fusion"]["model"]
    assert report["derived_weight_bytes"] == 0
    assert all(g["builds"] == 0 and g["bitwise_checks"] == {} for g in report["packed_groups"].values())
    session.uninstall()


def test_cached_kv_are_contiguous_and_reused(wan, registry) -> None:  # noqa: ANN001
    session = install_diffusion_accelerations(wan.model, {"wan_cross_kv_fusion": {"min_tokens": 0}},
                                              registry=registry)
    seen: list[torch.Tensor] = []
    handle = wan.model.blocks[0].attn2.norm_k.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        wan.run_request("r", 3, branches=("cond",))
    finally:
        handle.remove()
    assert all(k.is_contiguous() for k in seen)
    assert seen[1] is seen[2] and seen[0] is seen[1]  # the miss stored what it returned; hits return it again
    session.uninstall()


def test_concurrent_forwards_compute_without_the_cache(wan, registry, record) -> None:  # noqa: ANN001
    session = install_diffusion_accelerations(wan.model, {"wan_cross_kv_fusion": {"min_tokens": 0}},
                                              registry=registry)
    dense = {b: wan.call(0, b) for b in ("cond", "uncond")}
    barrier = threading.Barrier(2, timeout=30)
    hook = wan.model.blocks[0].register_forward_pre_hook(lambda m, a: (barrier.wait(), None)[1])  # forwards overlap
    results: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def run(branch: str) -> None:
        try:
            with request_scope(RequestContext(f"r-{branch}", branch, 0)):
                results[branch] = wan.call(0, branch)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(b,)) for b in ("cond", "uncond")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hook.remove()
    assert not errors
    assert all(torch.equal(results[b], dense[b]) for b in dense)
    concurrent = sum(record(session, f"r-{b}")["counters"].get("kv_cache_concurrent", 0) for b in dense)
    assert concurrent >= 2  # the second forward (and the rest of the first) computed without the cache
    assert session.handles("wan_cross_kv_fusion")["model"].cache.entries() <= 2 * 2
    session.uninstall()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.integers(1, 4), branches=st.sampled_from([("cond",), ("cond", "uncond")]), pack=st.booleans())
def test_hits_are_steps_minus_one_per_branch(builders, registry, record, steps: int,  # noqa: ANN001
                                             branches: tuple[str, ...], pack: bool) -> None:
    wan = builders()
    dense = wan.dense_outputs(steps, branches)
    session = install_diffusion_accelerations(wan.model, {"wan_cross_kv_fusion": {"min_tokens": 0, "pack": pack}},
                                              registry=registry)
    outputs = wan.run_request("r", steps, branches)
    assert all(torch.equal(a, b) for a, b in zip(outputs, dense, strict=True))
    counters = record(session, "r")["counters"]
    for branch in branches:
        assert counters.get(f"kv_cache_hit.{branch}", 0) == (steps - 1) * 2
        assert counters[f"kv_cache_miss.{branch}"] == 2
    session.uninstall()


def test_normalised_key_is_cached_and_follows_its_weight(wan, registry, record, builders) -> None:  # noqa: ANN001
    session = install_diffusion_accelerations(wan.model, {"wan_cross_kv_fusion": {"min_tokens": 0}},
                                              registry=registry)
    norm = wan.model.blocks[0].attn2.norm_k
    outputs: list[torch.Tensor] = []
    hook = norm.register_forward_hook(lambda m, args, out: outputs.append(out))

    def change(step: int) -> None:
        if step == 2:
            with torch.no_grad():
                norm.weight.mul_(1.5)  # the cached normalisation is stale from here on

    results = wan.run_request("r", 4, branches=("cond",), before_step=change)
    hook.remove()
    assert outputs[0] is outputs[1] and outputs[2] is outputs[3] and outputs[1] is not outputs[2]
    rec = record(session, "r")
    assert rec["modules"]["blocks.0.attn2.norm_k"] == {"computed_text_kv_norm": 2, "cached_text_kv_norm": 2}
    assert rec["modules"]["blocks.1.attn2.norm_k"] == {"computed_text_kv_norm": 1, "cached_text_kv_norm": 3}
    assert rec["counters"]["kv_cache_invalidated"] == 1
    reference = builders()
    reference.model.load_state_dict(wan.model.state_dict())
    session.uninstall()
    assert torch.equal(results[3], reference.call(3, "cond"))
    assert torch.equal(outputs[3], norm(wan.model.blocks[0].attn2.to_k(
        wan.model.condition_embedder(torch.tensor([0]), wan.prompts["cond"])[2])))
