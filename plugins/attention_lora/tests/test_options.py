"""Options: all three keys required, unknown keys named, scale range, frozen."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from worldfoundry_attention_lora.options import Options

from worldfoundry.errors import AccelerationOptionsError

GOOD = {"path": "attention-adapter.safetensors", "rank": 8, "scale": -1.0}


def test_parses_the_documented_spec() -> None:
    opts = Options.from_mapping(GOOD)
    assert (opts.path, opts.rank, opts.scale, opts.qkv_layout) == ("attention-adapter.safetensors", 8, -1.0, "per_head_interleaved")
    assert opts.to_json() == {**GOOD, "qkv_layout": "per_head_interleaved"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.rank = 4  # type: ignore[misc]
    assert Options.from_mapping({**GOOD, "scale": 1}).scale == 1.0
    assert Options.from_mapping({**GOOD, "qkv_layout": "qkv_blocks"}).qkv_layout == "qkv_blocks"


@pytest.mark.parametrize("missing", ["path", "rank", "scale"])
def test_all_three_keys_are_required(missing: str) -> None:
    with pytest.raises(AccelerationOptionsError, match=rf"missing required option\(s\) \['{missing}'\]"):
        Options.from_mapping({k: v for k, v in GOOD.items() if k != missing})


def test_unknown_keys_are_named() -> None:
    with pytest.raises(AccelerationOptionsError, match=r"unknown option\(s\) \['alpha', 'sclae'\]"):
        Options.from_mapping({**GOOD, "sclae": 1, "alpha": 8})


@pytest.mark.parametrize(("key", "value", "match"), [
    ("rank", 0, "rank must be an integer"), ("rank", 8.0, "rank must be an integer"),
    ("rank", True, "rank must be an integer"), ("rank", 2000, "rank must be an integer"),
    ("scale", 1.5, r"scale must be in \[-1, 1\]"), ("scale", -1.0001, r"scale must be in \[-1, 1\]"),
    ("scale", math.nan, r"scale must be in \[-1, 1\]"), ("scale", math.inf, r"scale must be in \[-1, 1\]"),
    ("scale", "-1", "scale must be a number"), ("scale", False, "scale must be a number"),
    ("path", "", "path must be a non-empty"), ("path", 3, "path must be a non-empty"),
    ("qkv_layout", "interleaved", "qkv_layout must be one of"),
])
def test_invalid_values(key: str, value: object, match: str) -> None:
    with pytest.raises(AccelerationOptionsError, match=match):
        Options.from_mapping({**GOOD, key: value})


@settings(max_examples=30, deadline=None)
@given(scale=st.floats(allow_nan=True, allow_infinity=True))
def test_scale_accepted_exactly_in_closed_unit_interval(scale: float) -> None:
    if -1.0 <= scale <= 1.0:
        assert Options.from_mapping({**GOOD, "scale": scale}).scale == scale
    else:
        with pytest.raises(AccelerationOptionsError):
            Options.from_mapping({**GOOD, "scale": scale})


def test_in_memory_state_has_no_path() -> None:
    opts = Options.from_mapping({"rank": 4, "scale": 0.5}, path_required=False)
    assert opts.path is None
    with pytest.raises(AccelerationOptionsError, match="path cannot be combined"):
        Options.from_mapping(GOOD, path_required=False)
    with pytest.raises(AccelerationOptionsError, match="options must be a mapping"):
        Options.from_mapping([("rank", 4)])  # type: ignore[arg-type]
