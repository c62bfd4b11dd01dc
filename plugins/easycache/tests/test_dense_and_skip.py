"""Threshold 0 is the dense model; a positive threshold skips (and counts) steps; results are reproducible."""

from __future__ import annotations

import inspect
import json

import torch

from worldfoundry.core.acceleration.installer import install_diffusion_accelerations

HUGE = 1e30  # every step the controller may skip is skipped


def _note(session, request_id, expert="model"):
    report = session.execution_report()["plugins"]["easycache"][expert]
    return report["requests"][request_id]


def test_threshold_zero_is_bitwise_the_dense_model(helpers, registry):
    model = helpers.tiny_wan()
    loop = helpers.loop({"model": model})
    dense = loop.run("dense", helpers.inputs(), steps=6)
    session = install_diffusion_accelerations(model, {"easycache": {"threshold": 0.0, "warmup_steps": 0}},
                                              registry=registry)
    cached = loop.run("r1", helpers.inputs(), steps=6)
    assert torch.equal(cached.latents, dense.latents)
    for a, b in zip(cached.outputs, dense.outputs, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("cond", "uncond"))
    record = _note(session, "r1")
    assert record["counters"] == {"computed": 12}
    assert record["modules"] == {"<root>": {"computed": 12}}
    assert record["skipped"] == {}
    assert record["notes"]["easycache"]["branches"]["cond"]["pattern"] == "CCCCCC"
    assert session.receipt.exact is True
    session.uninstall()


def test_skipping_happens_and_is_counted(helpers, registry):
    model = helpers.tiny_wan()
    loop = helpers.loop({"model": model})
    dense = loop.run("dense", helpers.inputs(), steps=8)
    session = install_diffusion_accelerations(
        model, {"easycache": {"threshold": HUGE, "warmup_steps": 2, "final_dense_steps": 1}}, registry=registry
    )
    cached = loop.run("r1", helpers.inputs(), steps=8)
    record = _note(session, "r1")
    summary = record["notes"]["easycache"]
    # two warm-up steps give the rate; the final step is dense; everything between is reused
    assert summary["branches"]["cond"]["pattern"] == "CCSSSSSC"
    assert summary["branches"]["uncond"]["pattern"] == "CCSSSSSC"
    assert summary["outcome"] == "completed"
    assert record["skipped"] == {"steps": 10}
    assert record["counters"]["computed"] == 6
    assert len(record["traces"]["accumulated_error.cond"]) == 5
    assert all(k is not None and k > 0 for k in record["traces"]["k.cond"])
    assert "accumulated_error.uncond" not in record["traces"]  # the cond branch decides for the pair
    assert not torch.equal(cached.latents, dense.latents)
    assert torch.isfinite(cached.latents).all()
    # a reused step returns x_t + Δ of the last computed step exactly
    x2 = cached.outputs[2]["cond"]
    assert x2.shape == dense.outputs[2]["cond"].shape
    assert session.receipt.exact is False
    session.uninstall()


def test_skipped_output_is_input_plus_cached_transformation(helpers, registry):
    model = helpers.tiny_wan()
    loop = helpers.loop({"model": model})
    session = install_diffusion_accelerations(
        model, {"easycache": {"threshold": HUGE, "warmup_steps": 2, "final_dense_steps": 0}}, registry=registry
    )
    result = loop.run("r1", helpers.inputs(), steps=3, cfg=False)
    x1, x2 = result.inputs[1], result.inputs[2]
    v1, v2 = result.outputs[1]["cond"], result.outputs[2]["cond"]
    delta = v1.float() - x1.float()
    assert torch.equal(v2, (x2.float() + delta).to(v2.dtype))
    assert _note(session, "r1")["notes"]["easycache"]["branches"]["cond"]["pattern"] == "CCS"
    session.uninstall()


def test_threshold_controls_the_number_of_skips(helpers, registry):
    model = helpers.tiny_wan()
    loop = helpers.loop({"model": model})
    skipped = []
    for threshold in (1e-9, 0.5, HUGE):
        session = install_diffusion_accelerations(
            model, {"easycache": {"threshold": threshold, "warmup_steps": 2}}, registry=registry
        )
        loop.run(f"t{threshold}", helpers.inputs(), steps=8, cfg=False)
        skipped.append(_note(session, f"t{threshold}")["skipped"].get("steps", 0))
        session.uninstall()
    assert skipped[0] == 0
    assert skipped[0] <= skipped[1] <= skipped[2] == 5


def test_separate_branch_decision_lets_each_branch_decide(helpers, registry):
    model = helpers.tiny_wan()
    loop = helpers.loop({"model": model})
    session = install_diffusion_accelerations(
        model, {"easycache": {"threshold": HUGE, "warmup_steps": 2, "branch_decision": "separate"}}, registry=registry
    )
    loop.run("r1", helpers.inputs(), steps=6)
    record = _note(session, "r1")
    assert set(record["traces"]) >= {"accumulated_error.cond", "accumulated_error.uncond", "k.cond", "k.uncond"}
    branches = record["notes"]["easycache"]["branches"]
    assert branches["cond"]["pattern"] == branches["uncond"]["pattern"] == "CCSSSC"
    session.uninstall()


def test_repeated_identical_request_is_bitwise_identical(helpers, registry):
    model = helpers.tiny_wan()
    loop = helpers.loop({"model": model})
    session = install_diffusion_accelerations(
        model, {"easycache": {"threshold": 0.4, "warmup_steps": 2}}, registry=registry
    )
    first = loop.run("a", helpers.inputs(), steps=8)
    second = loop.run("b", helpers.inputs(), steps=8)
    assert torch.equal(first.latents, second.latents)
    note_a = _note(session, "a")
    note_b = _note(session, "b")
    assert note_a["notes"] == note_b["notes"]
    assert note_a["traces"] == note_b["traces"]
    assert note_a["skipped"].get("steps", 0) > 0
    session.uninstall()


def test_interleaved_requests_do_not_share_state(helpers, registry):
    model = helpers.tiny_wan()
    loop = helpers.loop({"model": model})
    session = install_diffusion_accelerations(
        model, {"easycache": {"threshold": 0.4, "warmup_steps": 2}}, registry=registry
    )
    alone_a = loop.run("alone-a", helpers.inputs(1), steps=6)
    alone_b = loop.run("alone-b", helpers.inputs(2), steps=6)

    # run both requests step by step, alternating: a's and b's calls interleave on one model
    a = loop.iterate("inter-a", helpers.inputs(1), steps=6)
    b = loop.iterate("inter-b", helpers.inputs(2), steps=6)
    results = {}
    for _ in range(5):  # steps 0..4; the sixth step ends the requests
        results["a"] = next(a)
        results["b"] = next(b)
    assert "inter-a" in loop.guard.active_request_ids() and "inter-b" in loop.guard.active_request_ids()
    results["a"], results["b"] = next(a), next(b)  # the final yield comes after end_request
    assert loop.guard.active_request_ids() == ()
    assert torch.equal(results["a"].latents, alone_a.latents)
    assert torch.equal(results["b"].latents, alone_b.latents)
    assert _note(session, "inter-a")["notes"] == _note(session, "alone-a")["notes"]
    assert _note(session, "inter-b")["notes"] == _note(session, "alone-b")["notes"]
    assert _note(session, "inter-a")["skipped"].get("steps", 0) > 0
    session.uninstall()


def test_uninstall_restores_the_model_exactly(helpers, registry):
    model = helpers.tiny_wan()
    loop = helpers.loop({"model": model})
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    signature = inspect.signature(model.forward)
    dense = loop.run("dense", helpers.inputs(), steps=4)
    session = install_diffusion_accelerations(
        model, {"easycache": {"threshold": HUGE, "warmup_steps": 1}}, registry=registry
    )
    assert "forward" in model.__dict__
    assert inspect.signature(model.forward) == signature
    loop.run("cached", helpers.inputs(), steps=4)
    handle = session.handles("easycache")["model"]
    session.uninstall()
    assert "forward" not in model.__dict__
    assert handle.held_tensors() == [] and handle.active_requests() == ()
    after = model.state_dict()
    assert list(after) == list(state_before)
    assert all(torch.equal(after[k], state_before[k]) for k in after)
    again = loop.run("again", helpers.inputs(), steps=4)
    assert torch.equal(again.latents, dense.latents)
    session.uninstall()  # idempotent
    final = session.execution_report()
    assert final["installed"] is False
    json.dumps(final)


def test_receipt_stays_bounded_over_1000_requests(helpers, registry):
    model = helpers.tiny_wan(num_layers=1)
    loop = helpers.loop({"model": model})
    session = install_diffusion_accelerations(
        model, {"easycache": {"threshold": HUGE, "warmup_steps": 2, "final_dense_steps": 0}}, registry=registry
    )
    inputs = helpers.inputs()
    sizes = []
    for i in range(1000):
        loop.run(f"req-{i}", inputs, steps=3, cfg=False)
        if i in (20, 999):
            sizes.append(len(json.dumps(session.execution_report())))
    report = session.execution_report()["plugins"]["easycache"]["model"]
    assert len(report["requests"]) == 16
    assert report["dropped_requests"] == 1000 - 16
    assert report["totals"]["skipped_steps"] == 1000
    assert report["totals"]["computed"] == 2000
    # same number of kept requests, same shape: the size only varies with the digits of the ids
    assert sizes[1] <= sizes[0] * 1.1
    handle = session.handles("easycache")["model"]
    assert handle.active_requests() == () and handle.held_tensors() == []
    session.uninstall()


def test_image_to_video_inputs_cache_the_noisy_latent_channels(helpers, registry):
    """``hidden_states`` = [noisy latent, condition channels]; the transformation is in the latent channels."""
    from worldfoundry.core.acceleration.context import RequestContext, request_scope

    model = helpers.tiny_wan(in_channels=8, out_channels=4)
    loop = helpers.loop({"model": model})
    session = install_diffusion_accelerations(
        model, {"easycache": {"threshold": HUGE, "warmup_steps": 2, "final_dense_steps": 0}}, registry=registry
    )
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 2, 4, 4, generator=gen)
    condition = torch.randn(1, 4, 2, 4, 4, generator=gen)
    text = torch.randn(1, 6, 16, generator=gen)
    ts = helpers.timesteps(3)
    outs, inputs = [], []
    loop.guard.begin_request("i2v")
    try:
        for i, t in enumerate(ts):
            inputs.append(x)
            with request_scope(RequestContext("i2v", "cond", i, t, "model", 3)), torch.no_grad():
                out = model(hidden_states=torch.cat([x, condition], dim=1), timestep=torch.tensor([t]),
                            encoder_hidden_states=text, return_dict=False)[0]
            outs.append(out)
            x = x - 0.3 * out
    finally:
        loop.guard.end_request("i2v")
    assert _note(session, "i2v")["notes"]["easycache"]["branches"]["cond"]["pattern"] == "CCS"
    delta = outs[1] - inputs[1]
    assert torch.equal(outs[2], inputs[2] + delta)
    session.uninstall()


def test_skipped_steps_keep_the_output_structure(helpers, registry):
    """``return_dict=True`` gives a ``Transformer2DModelOutput`` on computed and on reused steps."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    from worldfoundry.core.acceleration.context import RequestContext, request_scope

    model = helpers.tiny_wan()
    loop = helpers.loop({"model": model})
    session = install_diffusion_accelerations(
        model, {"easycache": {"threshold": HUGE, "warmup_steps": 2, "final_dense_steps": 0}}, registry=registry
    )
    inputs = helpers.inputs()
    x = inputs.latents
    outs = []
    loop.guard.begin_request("dict")
    try:
        for i, t in enumerate(helpers.timesteps(3)):
            with request_scope(RequestContext("dict", "cond", i, t, "model", 3)), torch.no_grad():
                out = model(hidden_states=x, timestep=torch.tensor([t]), encoder_hidden_states=inputs.cond)
            outs.append(out)
            x = x - 0.3 * out.sample
    finally:
        loop.guard.end_request("dict")
    assert all(type(o) is Transformer2DModelOutput and list(o.keys()) == ["sample"] for o in outs)
    assert _note(session, "dict")["notes"]["easycache"]["branches"]["cond"]["pattern"] == "CCS"
    session.uninstall()
