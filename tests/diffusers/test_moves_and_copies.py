"""Moves while installed (followed or refused at the call), and copies / saves before, during, after install."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import EXACT_SPECS, same_state, state
from diffusers import WanTransformer3DModel
from pipelines import wan_transformer

from worldfoundry.core.acceleration.guard import attach_request_guard, detach_request_guard, get_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.errors import InferenceViewError

#: plugins that own where (or in which dtype) weights live: moves are refused at the call
REFUSE_MOVES = {"resident_blocks"}
DTYPES = [torch.float64, torch.bfloat16, torch.float16]


def tiny_wan(seed: int = 0) -> torch.nn.Module:
    return wan_transformer(seed)


def forward(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 4, 4, generator=g).to(dtype), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 6, 16, generator=g).to(dtype))
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("plugin", sorted(EXACT_SPECS))
def test_move_while_installed_then_uninstall_equals_the_same_move_untouched(plugin, dtype):
    model, untouched = tiny_wan(), tiny_wan()
    session = install_diffusion_accelerations(model, {plugin: EXACT_SPECS[plugin]})
    if plugin in REFUSE_MOVES:
        with pytest.raises(InferenceViewError, match=f"uninstall {plugin} first"):
            model.to(dtype)
        session.uninstall()
        model.to(dtype)
    else:
        model.to(dtype)
        session.uninstall()
        assert session.restore_differences == []
    untouched.to(dtype)
    assert same_state(state(model), state(untouched))
    for (name, a), (_, b) in zip(model.named_buffers(), untouched.named_buffers(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name  # RoPE buffers follow the move too
    assert torch.equal(forward(model, dtype), forward(untouched, dtype))


@pytest.mark.parametrize("plugin", sorted(EXACT_SPECS))
def test_copies_are_refused_while_installed_and_work_after(plugin, tmp_path):
    model = tiny_wan()
    reference = forward(model)
    session = install_diffusion_accelerations(model, {plugin: EXACT_SPECS[plugin]})
    for action in (lambda: copy.deepcopy(model), lambda: pickle.dumps(model), lambda: torch.save(model, io.BytesIO())):
        with pytest.raises(InferenceViewError, match="uninstall first"):
            action()
    for safe in (True, False):  # saving the weights works while installed, in both serialisations
        target = tmp_path / f"installed-{safe}"
        model.save_pretrained(target, safe_serialization=safe)
        reloaded = WanTransformer3DModel.from_pretrained(target).eval()
        assert same_state(state(reloaded), state(tiny_wan()))
        again = install_diffusion_accelerations(reloaded, {plugin: EXACT_SPECS[plugin]})  # and installs again
        again.uninstall()
    session.uninstall()
    clone = copy.deepcopy(model)
    assert torch.equal(forward(clone), reference)
    restored = pickle.loads(pickle.dumps(model))
    assert torch.equal(forward(restored), reference)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert torch.equal(forward(torch.load(buffer, weights_only=False)), reference)


def test_the_guard_deep_copies_and_pickles_as_a_fresh_idle_guard_and_detaches():
    model = tiny_wan()
    before = (dict(model._forward_pre_hooks), dict(model._forward_hooks), set(model.__dict__))
    guard = attach_request_guard(model)
    clone = copy.deepcopy(model)
    copied = get_request_guard(clone)
    assert copied is not None and copied is not guard and copied.active_request_ids() == ()
    with copied.request("on-the-copy"):
        forward(clone)
    assert guard.active_request_ids() == ()
    restored = pickle.loads(pickle.dumps(model))
    assert get_request_guard(restored) is not None
    for m in (model, clone, restored):
        assert detach_request_guard(m)
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks), set(model.__dict__)) == before
    assert not clone._forward_pre_hooks and "_apply" not in clone.__dict__
