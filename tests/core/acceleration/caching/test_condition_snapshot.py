"""Conditioning snapshots: identity, version counter, shape, inference tensors by content, type checks."""

from __future__ import annotations

import gc
import re

import pytest
import torch

from worldfoundry.core.acceleration.caching import ConditionSnapshot
from worldfoundry.errors import InvalidRequestError


def _conditions():
    return {
        "encoder_hidden_states": torch.randn(1, 4, 8),
        "encoder_hidden_states_image": None,
        "attention_kwargs": {"scale": 1.0, "masks": [torch.ones(2), (torch.zeros(1), "tag")]},
    }


def test_unchanged_conditions_match():
    cond = _conditions()
    snap = ConditionSnapshot.capture(cond)
    assert snap.difference(cond) is None
    assert snap.difference(dict(cond)) is None  # a new dict with the same objects still matches
    assert snap.tensors() == []  # normal tensors are tracked by reference and version only


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["encoder_hidden_states"].mul_(2.0), "encoder_hidden_states: modified in place"),
        (lambda c: c.__setitem__("encoder_hidden_states", c["encoder_hidden_states"].clone()),
         "encoder_hidden_states: a different tensor object"),
        (lambda c: c["attention_kwargs"]["masks"][0].zero_(), r"attention_kwargs\.masks\[0\]: modified in place"),
        (lambda c: c["attention_kwargs"].__setitem__("scale", 0.5), r"attention_kwargs\.scale: value changed"),
        (lambda c: c["attention_kwargs"].__setitem__("extra", 1), r"attention_kwargs: keys changed"),
        (lambda c: c.__setitem__("encoder_hidden_states_image", torch.zeros(1)), "changed type"),
        (lambda c: c["attention_kwargs"]["masks"].append(1), "changed type or length"),
        (lambda c: c.pop("encoder_hidden_states_image"), "arguments changed"),
    ],
)
def test_each_kind_of_change_is_reported(change, message):
    cond = _conditions()
    snap = ConditionSnapshot.capture(cond)
    change(cond)
    diff = snap.difference(cond)
    assert diff is not None
    assert re.search(message, diff), diff


def test_views_and_resizes():
    base = torch.randn(2, 4)
    view = base[0]
    snap = ConditionSnapshot.capture({"c": view})
    base[1].add_(1.0)  # an in-place edit of the base bumps the shared version counter
    assert snap.difference({"c": view}) == "c: modified in place"
    t = torch.randn(3)
    snap = ConditionSnapshot.capture({"c": t})
    t.resize_(4)
    assert snap.difference({"c": t}) is not None


def test_a_collected_tensor_never_matches_a_new_one():
    t = torch.randn(3)
    snap = ConditionSnapshot.capture({"c": t})
    del t
    gc.collect()
    assert snap.difference({"c": torch.randn(3)}) == "c: a different tensor object"


def test_inference_tensors_are_compared_by_content():
    with torch.inference_mode():
        t = torch.randn(1, 4, 8)
        snap = ConditionSnapshot.capture({"c": t})
        assert len(snap.tensors()) == 1 and snap.tensors()[0] is not t
        assert snap.difference({"c": t}) is None
        t.add_(1e-3)
        assert snap.difference({"c": t}) == "c: modified in place"


@pytest.mark.parametrize("bad", [object(), {1, 2}, lambda: None, torch.nn.Linear(1, 1)])
def test_unsupported_condition_types_are_named(bad):
    cond = {"attention_kwargs": {"inner": [bad]}}
    with pytest.raises(InvalidRequestError, match=r"'attention_kwargs\.inner\[0\]'.*tensors, mappings"):
        ConditionSnapshot.capture(cond)
    with pytest.raises(InvalidRequestError, match=r"'attention_kwargs\.inner\[0\]'"):
        ConditionSnapshot.validate(cond)


def test_scalars_compare_by_type_and_value():
    snap = ConditionSnapshot.capture({"flag": True, "n": 1, "s": "a", "b": b"x", "none": None})
    assert snap.difference({"flag": True, "n": 1, "s": "a", "b": b"x", "none": None}) is None
    assert snap.difference({"flag": 1, "n": 1, "s": "a", "b": b"x", "none": None}) == "flag: value changed"
