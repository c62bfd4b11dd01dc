"""PatchRecorder: every change recorded, undone in reverse, exactly once, slots and order kept."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

from worldfoundry.core.acceleration.patching import NOTSET, DuplicatePatchError, PatchRecorder, patch_names
from worldfoundry.errors import AccelerationRestoreError, WorldFoundryError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.c = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("tmp", torch.zeros(3), persistent=False)
        self.label = "net"

    def forward(self, x: torch.Tensor, *, gain: float = 1.0) -> torch.Tensor:
        return self.c(self.b(self.a(x))) * self.scale * gain


def snapshot(net: nn.Module) -> dict[str, object]:
    return {
        "params": [(n, id(p)) for n, p in net.named_parameters()],
        "buffers": [(n, id(b)) for n, b in net.named_buffers()],
        "modules": [(n, id(m)) for n, m in net.named_modules()],
        "dict": {k: id(v) for k, v in net.__dict__.items()},
        "state": list(net.state_dict()),
        "non_persistent": set(net._non_persistent_buffers_set),
        "hooks": (list(net._forward_hooks), list(net._forward_pre_hooks)),
    }


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


def test_notset_is_a_singleton():
    assert type(NOTSET)() is NOTSET and repr(NOTSET) == "NOTSET"


def test_setattr_of_absent_attribute_restores_notset(net):
    before = snapshot(net)
    rec = PatchRecorder()
    rec.setattr(net, "new_attr", 5)
    rec.setattr(net, "label", "changed")
    assert net.new_attr == 5 and net.label == "changed"
    rec.undo()
    assert not hasattr(net, "new_attr") and net.label == "net"
    assert snapshot(net) == before


def test_parameters_buffers_and_modules_keep_slot_and_order(net):
    before = snapshot(net)
    rec = PatchRecorder()
    new_weight = nn.Parameter(torch.zeros(3, 3))
    rec.setattr(net.b, "weight", new_weight)
    rec.setattr(net, "tmp", torch.ones(3))
    rec.setattr(net, "scale", torch.full((3,), 2.0))
    replacement = nn.Identity()
    old = rec.replace_module(net, "b", replacement)
    assert old is not replacement
    assert [n for n, _ in net.named_children()] == ["a", "b", "c"]
    assert net.b is replacement and "tmp" not in net.state_dict() and "scale" in net.state_dict()
    assert old.weight is new_weight
    rec.undo()
    assert snapshot(net) == before


def test_delattr_reinserts_at_the_same_position(net):
    before = snapshot(net)
    rec = PatchRecorder()
    rec.delattr(net, "b")
    rec.delattr(net, "tmp")
    rec.delattr(net.a, "bias")
    rec.delattr(net, "label")
    assert "b" not in net._modules and "tmp" not in net._buffers and "bias" not in net.a._parameters
    assert not hasattr(net, "label")
    with pytest.raises(AttributeError, match="no instance attribute 'missing'"):
        rec.delattr(net, "missing")
    rec.undo()
    assert snapshot(net) == before
    assert "tmp" in net._non_persistent_buffers_set


def test_added_modules_buffers_parameters_and_hooks_are_removed(net):
    before = snapshot(net)
    calls = []
    with PatchRecorder() as rec:
        rec.add_module(net, "extra", nn.ReLU())
        rec.register_buffer(net, "derived", torch.ones(2))
        rec.register_parameter(net.a, "delta", nn.Parameter(torch.zeros(3)))
        rec.hook(net.register_forward_hook(lambda m, a, o: calls.append("hook")), "probe hook")
        rec.callback(lambda: calls.append("callback"), "note")
        with pytest.raises(ValueError, match="already has an attribute 'a'"):
            rec.add_module(net, "a", nn.ReLU())
        with pytest.raises(ValueError, match="already has an attribute 'scale'"):
            rec.register_buffer(net, "scale", torch.ones(1))
        assert "derived" not in net.state_dict()  # non-persistent by default
        net(torch.ones(1, 3))
        patches = rec.pop_all()
    assert len(patches) == 5 and calls == ["hook"]
    assert patches.descriptions()[3] == "probe hook"
    patches.undo()
    assert calls == ["hook", "callback"]
    assert snapshot(net) == before


def test_wrap_forward_keeps_signature_and_undo_removes_instance_forward(net):
    before = snapshot(net)
    signature = inspect.signature(net.forward)
    x = torch.randn(2, 3)
    expected = net(x, gain=2.0)

    def make_wrapper(original):
        def forward(*args, **kwargs):
            return original(*args, **kwargs) + 1

        return forward

    rec = PatchRecorder()
    wrapper = rec.wrap_forward(net, make_wrapper, name="plus-one")
    assert net.forward is wrapper
    assert inspect.signature(net.forward) == signature
    assert net.forward.__name__ == "forward" and patch_names(net.forward)[0] == "plus-one"
    assert torch.equal(net(x, gain=2.0), expected + 1)
    rec.wrap_forward(net, make_wrapper, name="plus-two")
    assert patch_names(net.forward)[:2] == ["plus-two", "plus-one"]
    assert inspect.signature(net.forward) == signature
    with pytest.raises(DuplicatePatchError, match="plus-one"):
        rec.wrap_forward(net, make_wrapper, name="plus-one")
    assert issubclass(DuplicatePatchError, WorldFoundryError)
    rec.undo()
    assert "forward" not in net.__dict__
    assert torch.equal(net(x, gain=2.0), expected)
    assert snapshot(net) == before


def test_undo_is_idempotent():
    obj = type("Plain", (), {})()
    rec = PatchRecorder()
    rec.setattr(obj, "x", 1)
    rec.undo()
    assert not hasattr(obj, "x")
    obj.x = "set by someone else later"
    rec.undo()  # nothing left to undo
    assert obj.x == "set by someone else later" and len(rec) == 0


def test_undo_continues_past_a_failing_entry_and_reports_it(net):
    before = snapshot(net)
    rec = PatchRecorder()
    rec.setattr(net, "first", 1)
    rec.callback(lambda: (_ for _ in ()).throw(RuntimeError("cannot undo this")), "broken")
    rec.setattr(net.a, "weight", nn.Parameter(torch.zeros(3, 3)))
    with pytest.raises(AccelerationRestoreError, match="cannot undo this") as info:
        rec.undo()
    assert len(info.value.errors) == 1
    assert snapshot(net) == before  # the entries before and after the broken one were undone
    rec.undo()  # and the failing entry is not retried


def test_exiting_the_block_with_an_error_undoes_the_partial_change(net):
    before = snapshot(net)
    with pytest.raises(KeyError), PatchRecorder() as rec:
        rec.setattr(net, "scale", torch.zeros(3))
        rec.replace_module(net, "missing_child", nn.ReLU())
    assert snapshot(net) == before


def test_setattr_type_checks_keep_slots_consistent(net):
    rec = PatchRecorder()
    with pytest.raises(TypeError, match="parameter"):
        rec.setattr(net.a, "weight", torch.zeros(3, 3))
    with pytest.raises(TypeError, match="buffer"):
        rec.setattr(net, "scale", 3)
    with pytest.raises(TypeError, match="submodule"):
        rec.setattr(net, "a", "not a module")
    assert len(rec) == 0
