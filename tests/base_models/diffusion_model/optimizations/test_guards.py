"""Fixed-weight lifecycle protection: refusals while active, detection of edits, exact removal."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

from worldfoundry.base_models.diffusion_model.optimizations.guards import (
    GUARDED_METHODS,
    install_weight_view_guard,
)
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.errors import InferenceViewError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ffn = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.norm(x))


def build() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList([Block(), Block()])
    model.head = nn.Linear(16, 4)
    return model.eval()


def guarded(model: nn.Module, plugin: str = "selective_fp8"):
    fixed = {"blocks.0.ffn.0": model.blocks[0].ffn[0], "blocks.1.ffn.2": model.blocks[1].ffn[2]}
    with PatchRecorder() as rec:
        guard = install_weight_view_guard(rec, model, fixed, plugin=plugin)
        patches = rec.pop_all()
    return guard, patches


def snapshot(model: nn.Module) -> dict:
    return {name: dict(m.__dict__) for name, m in model.named_modules()}


REFUSED_CALLS = {
    "state_dict": lambda m: m.state_dict(),
    "load_state_dict": lambda m: m.load_state_dict({}),
    "to dtype": lambda m: m.to(torch.float64),
    "to device": lambda m: m.to("cpu"),
    "half": lambda m: m.half(),
    "float": lambda m: m.float(),
    "bfloat16": lambda m: m.bfloat16(),
    "double": lambda m: m.double(),
    "cpu": lambda m: m.cpu(),
    "type": lambda m: m.type(torch.float64),
    "apply": lambda m: m._apply(lambda t: t),
    "train": lambda m: m.train(),
    "train(True)": lambda m: m.train(True),
}


@pytest.mark.parametrize("call", list(REFUSED_CALLS))
def test_root_operations_are_refused_with_the_plugin_name(call):
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    guard, patches = guarded(model)
    with pytest.raises(InferenceViewError, match="uninstall selective_fp8 first"):
        REFUSED_CALLS[call](model)
    patches.undo()
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert not model.training


@pytest.mark.parametrize("path", ["blocks", "blocks.0", "blocks.0.ffn", "blocks.0.ffn.0", "blocks.1.ffn.2"])
def test_ancestors_and_fixed_modules_are_guarded(path):
    model = build()
    guarded(model)
    module = model.get_submodule(path)
    with pytest.raises(InferenceViewError, match=f"module '{path}'"):
        module.state_dict()
    with pytest.raises(InferenceViewError, match=r"\.half\(\)"):
        module.half()


def test_unrelated_modules_and_eval_stay_usable():
    model = build()
    guarded(model)
    model.eval()  # train(False) is allowed
    model.blocks[0].ffn.eval()
    assert sorted(model.blocks[0].norm.state_dict()) == ["bias", "weight"]
    model.blocks[0].norm.to(torch.float64)  # not on a fixed path
    model.head.double()
    assert model.head.weight.dtype == torch.float64
    assert model.blocks[0].norm.weight.dtype == torch.float64


def test_parameter_assignment_is_refused():
    model = build()
    guarded(model)
    with pytest.raises(InferenceViewError, match="assigning a parameter on module 'blocks.0.ffn.0'"):
        model.blocks[0].ffn[0].weight = nn.Parameter(torch.zeros(32, 16))
    other = build()
    guarded(other, plugin="demo")  # the guard is generic over the plugin name
    with pytest.raises(InferenceViewError, match="while demo is active.*uninstall demo first"):
        other.state_dict()


def test_in_place_edits_and_replacements_are_detected():
    model = build()
    guard, patches = guarded(model)
    assert guard.paths == ("blocks.0.ffn.0", "blocks.1.ffn.2")
    guard.verify("blocks.0.ffn.0")
    with torch.no_grad():
        model.blocks[0].ffn[0].weight.mul_(2)
    assert guard.changed("blocks.0.ffn.0") == "weight was edited in place"
    with pytest.raises(InferenceViewError, match="blocks.0.ffn.0.weight was edited in place while selective_fp8"):
        guard.verify("blocks.0.ffn.0")
    model.blocks[1].ffn[2]._parameters["bias"] = nn.Parameter(torch.zeros(16))
    assert guard.changed("blocks.1.ffn.2") == "bias was replaced"
    patches.undo()


def test_undo_removes_every_patch_and_keeps_signatures():
    model = build()
    before = snapshot(model)
    signatures = {name: str(inspect.signature(getattr(model, name))) for name in GUARDED_METHODS}
    guard, patches = guarded(model)
    assert "state_dict" in model.__dict__ and "_apply" in model.blocks[0].ffn[0].__dict__
    assert "state_dict" not in model.head.__dict__
    assert {name: str(inspect.signature(getattr(model, name))) for name in GUARDED_METHODS} == signatures
    patches.undo()
    assert snapshot(model) == before
    model.double()  # allowed again
    assert model.blocks[0].ffn[0].weight.dtype == torch.float64


def test_unknown_path_is_a_programming_error():
    model = build()
    with PatchRecorder() as rec, pytest.raises(KeyError, match="not a module path"):
        install_weight_view_guard(rec, model, {"blocks.7.ffn.0": nn.Linear(2, 2)}, plugin="x")
    assert "state_dict" not in model.__dict__  # the recorder undid the partial guard
