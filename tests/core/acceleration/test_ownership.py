"""Ownership: undo only what was recorded; later changes are kept, spliced under, or named as collisions."""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.hooks import HookRegistry, ModelHook

from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.snapshot import ModuleTreeSnapshot, repair_leftovers
from worldfoundry.core.acceleration.spec import freeze_options, normalize_acceleration_spec, thaw_options


def _doubling(original):
    return lambda x: original(x) * 2


def test_untouched_patches_have_no_collisions_and_undo_exactly():
    lin = nn.Linear(2, 2)
    with PatchRecorder() as rec:
        rec.wrap_forward(lin, _doubling, name="double")
        rec.setattr(lin, "note", "ours")
        patches = rec.pop_all()
    assert patches.collisions() == []
    patches.undo()
    assert "forward" not in lin.__dict__ and "note" not in lin.__dict__


def test_a_plain_function_on_top_of_a_patched_forward_is_a_collision():
    lin = nn.Linear(2, 2)
    with PatchRecorder() as rec:
        ours = rec.wrap_forward(lin, _doubling, name="double")
        patches = rec.pop_all()
    lin.forward = lambda x: ours(x) + 1
    found = patches.collisions()
    assert len(found) == 1 and "Linear.forward was replaced since install" in found[0]


def test_a_diffusers_hook_on_a_patched_forward_is_spliced_and_kept():
    lin = nn.Linear(2, 2)
    x = torch.randn(3, 2)
    with PatchRecorder() as rec:
        rec.wrap_forward(lin, _doubling, name="double")
        patches = rec.pop_all()

    class AddOne(ModelHook):
        def post_forward(self, module, output):
            return output + 1

    HookRegistry.check_if_exists_or_initialize(lin).register_hook(AddOne(), "user")
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias) * 2 + 1)
    assert patches.collisions() == []
    patches.undo()
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias) + 1)  # the user's hook stays
    HookRegistry.check_if_exists_or_initialize(lin).remove_hook("user")
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_a_replaced_parameter_is_kept_not_a_collision():
    lin = nn.Linear(2, 2)
    with PatchRecorder() as rec:
        rec.setattr(lin, "weight", nn.Parameter(torch.zeros(2, 2)))
        patches = rec.pop_all()
    users = nn.Parameter(torch.ones(2, 2))
    lin.weight = users
    kept: dict = {}
    assert patches.collisions(kept=kept) == []
    assert len(kept) == 1
    patches.keep(frozenset(kept))
    patches.undo()
    assert lin.weight is users


def test_two_patches_on_one_slot_are_checked_once_against_the_last():
    lin = nn.Linear(2, 2)
    with PatchRecorder() as first:
        first.wrap_forward(lin, _doubling, name="a")
        a = first.pop_all()
    with PatchRecorder() as second:
        second.wrap_forward(lin, _doubling, name="b")
        b = second.pop_all()
    seen: set = set()
    assert b.collisions(seen) == [] and a.collisions(seen) == []
    b.undo()
    a.undo()
    assert "forward" not in lin.__dict__


def test_the_snapshot_repairs_only_the_installs_own_leftovers():
    model = nn.Sequential(nn.Linear(2, 2))
    before = ModuleTreeSnapshot(model)
    model[0].leftover = "install forgot me"  # the install's change, never undone
    after = ModuleTreeSnapshot(model)
    model[0].users = "mine"  # the user's change after install
    model.to(torch.float64)  # and a move
    found = repair_leftovers(before, after)
    assert found == ["0: attribute 'leftover' added"]
    assert "leftover" not in model[0].__dict__ and model[0].users == "mine"
    assert model[0].weight.dtype == torch.float64


def test_the_spec_is_normalised_in_one_place():
    spec = normalize_acceleration_spec({"a": True, "b": {"x": [1, 2]}, "c": False})
    assert spec == {"a": {}, "b": {"x": [1, 2]}}
    frozen = freeze_options(spec["b"])
    assert frozen["x"] == (1, 2) and thaw_options(frozen) == {"x": [1, 2]}
    assert thaw_options({"dtype": torch.bfloat16}) == {"dtype": "bfloat16"}
