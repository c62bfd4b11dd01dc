"""Request lifecycle: missing context, release on normal end and on exceptions, conditioning snapshots."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.errors import InvalidRequestError, RequestError

HUGE = 1e30
SPEC = {"easycache": {"threshold": HUGE, "warmup_steps": 2, "final_dense_steps": 1}}


@pytest.fixture
def setup(helpers, registry):
    model = helpers.tiny_wan()
    loop = helpers.loop({"model": model})
    session = install_diffusion_accelerations(model, SPEC, registry=registry)
    handle = session.handles("easycache")["model"]
    yield model, loop, session, handle
    if session.installed:
        session.uninstall()


def _call(model, inputs, ctx, **overrides):
    kwargs = dict(hidden_states=inputs.latents, timestep=torch.tensor([500.0]), encoder_hidden_states=inputs.cond,
                  return_dict=False)
    kwargs.update(overrides)
    if ctx is None:
        with torch.no_grad():
            return model(**kwargs)
    with request_scope(ctx), torch.no_grad():
        return model(**kwargs)


def _summary(session, request_id):
    return session.execution_report()["plugins"]["easycache"]["model"]["requests"][request_id]


def test_call_outside_a_request_is_a_clear_error(setup, helpers):
    model, loop, _, _ = setup
    with pytest.raises(RequestError, match="called outside a request"):
        _call(model, helpers.inputs(), None)


def test_call_for_a_request_that_was_not_begun(setup, helpers):
    model, _, _, _ = setup
    with pytest.raises(RequestError, match="was not begun"):
        _call(model, helpers.inputs(), RequestContext("ghost", "cond", 0, 500.0, None, 4))


@pytest.mark.parametrize(
    ("ctx", "message"),
    [
        (RequestContext("r", "cond", None, 500.0, None, 4), "no step_index"),
        (RequestContext("r", "cond", 0, 500.0, None, None), "neither num_steps"),
        (RequestContext("r", "left", 0, 500.0, None, 4), "unknown CFG branch"),
        (RequestContext("r", "cond", 5, 500.0, None, 4), "outside its phase"),
    ],
)
def test_missing_or_bad_step_information(setup, helpers, ctx, message):
    model, loop, _, handle = setup
    loop.guard.begin_request("r")
    try:
        with pytest.raises(RequestError, match=message):
            _call(model, helpers.inputs(), ctx)
    finally:
        loop.guard.end_request("r")
    assert handle.active_requests() == ()


def test_conditions_of_unsupported_type_are_refused_by_name(setup, helpers):
    model, loop, _, _ = setup
    loop.guard.begin_request("r")
    try:
        with pytest.raises(InvalidRequestError, match=r"'attention_kwargs\.hook'.*tensors, mappings, lists/tuples"):
            _call(model, helpers.inputs(), RequestContext("r", "cond", 0, 500.0, None, 4),
                  attention_kwargs={"hook": object()})
    finally:
        loop.guard.end_request("r")


def test_normal_end_releases_every_tensor(setup, helpers):
    model, loop, session, handle = setup
    refs = []
    loop.run("r1", helpers.inputs(), steps=6,
             before_step=lambda i: refs.extend(weakref.ref(t) for t in handle.held_tensors()))
    assert refs, "the cache held tensors during the request"
    assert handle.active_requests() == () and handle.held_tensors() == []
    gc.collect()
    assert all(r() is None for r in refs)
    assert _summary(session, "r1")["notes"]["easycache"]["outcome"] == "completed"


def test_exception_between_steps_releases_everything_and_the_next_request_is_clean(setup, helpers):
    model, loop, session, handle = setup
    fresh = loop.run("fresh", helpers.inputs(), steps=8)
    refs = []

    def explode(i):
        refs.extend(weakref.ref(t) for t in handle.held_tensors())
        if i == 5:
            raise KeyError("scheduler failed")

    with pytest.raises(KeyError, match="scheduler failed"):
        loop.run("broken", helpers.inputs(), steps=8, before_step=explode)
    assert handle.active_requests() == () and handle.held_tensors() == []
    gc.collect()
    assert refs and all(r() is None for r in refs)
    summary = _summary(session, "broken")["notes"]["easycache"]
    assert summary["outcome"] == "aborted"
    assert summary["branches"]["cond"]["pattern"] == "CCSSS"
    again = loop.run("again", helpers.inputs(), steps=8)
    assert torch.equal(again.latents, fresh.latents)
    assert _summary(session, "again")["notes"] == _summary(session, "fresh")["notes"]


def test_exception_inside_the_model_releases_at_once(setup, helpers):
    model, loop, session, handle = setup
    inputs = helpers.inputs()
    loop.guard.begin_request("r")
    for i in range(3):
        _call(model, inputs, RequestContext("r", "cond", i, 900.0 - i, None, 6))
    assert handle.held_tensors()
    refs = [weakref.ref(t) for t in handle.held_tensors()]
    boom = model.blocks[0].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            # step 3 would be skipped with a huge threshold; new conditioning forces a compute here
            _call(model, inputs, RequestContext("r", "cond", 3, 897.0, None, 6), encoder_hidden_states=inputs.uncond)
    finally:
        boom.remove()
    assert handle.held_tensors() == []  # released before the request ends
    gc.collect()
    assert all(r() is None for r in refs)
    with pytest.raises(RequestError, match="failed earlier"):
        _call(model, inputs, RequestContext("r", "cond", 4, 896.0, None, 6))
    loop.guard.end_request("r")  # no completeness error for a failed request
    assert _summary(session, "r")["notes"]["easycache"]["outcome"] == "failed"
    assert handle.active_requests() == ()


def test_incomplete_request_is_an_error_after_release(setup, helpers):
    model, loop, session, handle = setup
    inputs = helpers.inputs()
    loop.guard.begin_request("short")
    for i in range(3):
        _call(model, inputs, RequestContext("short", "cond", i, 900.0 - i, None, 6))
    with pytest.raises(RequestError, match="phase left incomplete"):
        loop.guard.end_request("short")
    assert handle.active_requests() == () and handle.held_tensors() == []
    assert loop.guard.active_request_ids() == ()
    assert _summary(session, "short")["notes"]["easycache"]["outcome"] == "incomplete"


def test_in_place_edit_of_the_conditioning_invalidates_the_cache(setup, helpers):
    model, loop, session, _ = setup
    baseline = loop.run("base", helpers.inputs(), steps=8)
    inputs = helpers.inputs()

    def edit(i):
        if i == 4:
            inputs.cond.mul_(1.5)

    loop.run("edited", inputs, steps=8, before_step=edit)
    record = _summary(session, "edited")
    branches = record["notes"]["easycache"]["branches"]
    assert _summary(session, "base")["notes"]["easycache"]["branches"]["cond"]["pattern"] == "CCSSSSSC"
    # step 4 recomputes (snapshot changed) and step 5 too (the rate needs two computed steps)
    assert branches["cond"]["pattern"] == "CCSSCCSC"
    assert branches["cond"]["invalidations"] == 1 and branches["uncond"]["invalidations"] == 0
    assert branches["uncond"]["pattern"] == "CCSSCCSC"
    assert record["counters"]["snapshot_invalidations"] == 1
    assert record["traces"]["invalidated"] == ["encoder_hidden_states: modified in place"]
    assert baseline.latents.shape == inputs.latents.shape


def test_replaced_conditioning_tensor_invalidates_the_cache(setup, helpers):
    model, loop, session, _ = setup
    inputs = helpers.inputs()

    def replace(i):
        if i == 3:
            inputs.uncond = inputs.uncond.clone()

    loop.run("replaced", inputs, steps=8, before_step=replace)
    branches = _summary(session, "replaced")["notes"]["easycache"]["branches"]
    assert branches["uncond"]["invalidations"] == 1
    # the cond branch decided to skip step 3, but the uncond branch had no valid transformation left
    assert branches["cond"]["pattern"] == "CCSSSSSC"
    assert branches["uncond"]["pattern"] == "CCSCSSSC"


def test_inference_tensors_are_compared_by_content(setup, helpers):
    model, loop, session, _ = setup
    with torch.inference_mode():
        inputs = helpers.inputs()
        loop.run("clean", inputs, steps=8)
        inputs = helpers.inputs()

        def edit(i):
            if i == 4:
                inputs.cond.add_(0.25)

        loop.run("edited", inputs, steps=8, before_step=edit)
    assert _summary(session, "clean")["notes"]["easycache"]["branches"]["cond"]["pattern"] == "CCSSSSSC"
    branches = _summary(session, "edited")["notes"]["easycache"]["branches"]
    assert branches["cond"]["invalidations"] == 1
    assert branches["cond"]["pattern"] == "CCSSCCSC"


def test_positional_arguments_are_bound_by_name(setup, helpers):
    model, loop, session, _ = setup
    inputs = helpers.inputs()
    x = inputs.latents
    loop.guard.begin_request("pos")
    try:
        for i in range(4):
            t = 900.0 - 100.0 * i
            with request_scope(RequestContext("pos", "cond", i, t, None, 5)), torch.no_grad():
                out = model(x, torch.tensor([t]), inputs.cond, None, False)[0]
            x = x - 0.1 * out
        with request_scope(RequestContext("pos", "cond", 4, 500.0, None, 5)), torch.no_grad():
            model(x, torch.tensor([500.0]), inputs.cond, None, False)
    finally:
        loop.guard.end_request("pos")
    assert _summary(session, "pos")["notes"]["easycache"]["branches"]["cond"]["pattern"] == "CCSSC"
