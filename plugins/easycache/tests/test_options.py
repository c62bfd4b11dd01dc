"""EasyCache options: defaults, validation by name, frozen dataclass, spec normalisation."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.errors import AccelerationOptionsError
from worldfoundry_easycache import Options


def test_defaults_match_the_published_settings():
    opts = Options.from_mapping({})
    assert opts == Options(threshold=0.05, warmup_steps=10, final_dense_steps=1, branch_decision="cond")
    assert not opts.dense
    assert Options.from_mapping(None) == opts
    assert opts.to_json() == {"threshold": 0.05, "warmup_steps": 10, "final_dense_steps": 1, "branch_decision": "cond"}


def test_threshold_zero_is_dense_and_ints_are_accepted():
    opts = Options.from_mapping({"threshold": 0})
    assert opts.dense and opts.threshold == 0.0 and isinstance(opts.threshold, float)


def test_options_are_frozen():
    opts = Options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.threshold = 1.0  # type: ignore[misc]


def test_unknown_keys_are_rejected_by_name():
    with pytest.raises(AccelerationOptionsError, match=r"unknown option\(s\) \['treshold'\]") as info:
        Options.from_mapping({"treshold": 0.1})
    assert info.value.plugin == "easycache"
    assert "known options" in str(info.value)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"threshold": -0.1}, "threshold"),
        ({"threshold": math.inf}, "threshold"),
        ({"threshold": math.nan}, "threshold"),
        ({"threshold": "0.1"}, "threshold"),
        ({"threshold": True}, "threshold"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 2.0}, "warmup_steps"),
        ({"warmup_steps": False}, "warmup_steps"),
        ({"final_dense_steps": -3}, "final_dense_steps"),
        ({"final_dense_steps": "1"}, "final_dense_steps"),
        ({"branch_decision": "uncond"}, "branch_decision"),
        ({"branch_decision": None}, "branch_decision"),
    ],
)
def test_invalid_values_name_the_field(options, field):
    with pytest.raises(AccelerationOptionsError, match=field):
        Options.from_mapping(options)


def test_non_mapping_options_are_rejected():
    with pytest.raises(AccelerationOptionsError, match="expected a mapping"):
        Options.from_mapping([("threshold", 0.1)])  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(
    threshold=st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    warmup=st.integers(min_value=0, max_value=1000),
    final=st.integers(min_value=0, max_value=1000),
    decision=st.sampled_from(["cond", "separate"]),
)
def test_valid_options_round_trip_through_json(threshold, warmup, final, decision):
    opts = Options.from_mapping(
        {"threshold": threshold, "warmup_steps": warmup, "final_dense_steps": final, "branch_decision": decision}
    )
    assert Options.from_mapping(opts.to_json()) == opts
    assert opts.dense == (threshold == 0.0)
