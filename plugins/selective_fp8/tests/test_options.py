"""``selective_fp8`` options: defaults, validation by name, JSON form."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from worldfoundry_selective_fp8.options import Options

from worldfoundry.errors import AccelerationOptionsError


def test_defaults():
    opts = Options.from_mapping({})
    assert opts == Options(include=None, exclude=(), scaling="rowwise", use_fast_accum=False, min_tokens=1024,
                           fuse_gelu=True)
    assert Options.from_mapping(None) == opts
    assert opts.to_json() == {"include": None, "exclude": [], "scaling": "rowwise", "use_fast_accum": False,
                              "min_tokens": 1024, "fuse_gelu": True}


def test_issue_spec_parses_including_frozen_tuples():
    spec = {"include": ["blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2"], "exclude": [], "scaling": "rowwise",
            "use_fast_accum": False, "min_tokens": 1024}
    opts = Options.from_mapping(spec)
    assert opts.include == ("blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2")
    frozen = MappingProxyType({**spec, "include": tuple(spec["include"]), "exclude": ()})
    assert Options.from_mapping(frozen) == opts
    assert opts.to_json()["include"] == spec["include"]


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Options().min_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"includes": ["x"]}, r"unknown option\(s\) \['includes'\]; known options"),
        ({"include": "blocks.*.ffn.net.2"}, r"write \['blocks.\*.ffn.net.2'\]"),
        ({"include": []}, "at least one pattern"),
        ({"include": ["ok", ""]}, "non-empty strings"),
        ({"include": [3]}, "non-empty strings"),
        ({"exclude": "x"}, "exclude: expected a list"),
        ({"scaling": "tensorwise"}, r"only \['rowwise'\] is supported"),
        ({"use_fast_accum": 1}, "use_fast_accum: expected true/false"),
        ({"min_tokens": -1}, "min_tokens: expected an integer >= 0"),
        ({"min_tokens": True}, "min_tokens"),
        ({"min_tokens": 2.5}, "min_tokens"),
        ({"fuse_gelu": "yes"}, "fuse_gelu: expected true/false"),
    ],
)
def test_invalid_options_are_rejected_by_name(options, message):
    with pytest.raises(AccelerationOptionsError, match=message) as info:
        Options.from_mapping(options)
    assert info.value.plugin == "selective_fp8"


def test_non_mapping_is_rejected():
    with pytest.raises(AccelerationOptionsError, match="expected a mapping"):
        Options.from_mapping(["include"])  # type: ignore[arg-type]


@settings(max_examples=20, deadline=None)
@given(patterns=st.lists(st.text(min_size=1, max_size=12).filter(str.strip), min_size=1, max_size=4),
       min_tokens=st.integers(0, 10**6), fast=st.booleans(), fuse=st.booleans())
def test_round_trip_through_json(patterns, min_tokens, fast, fuse):
    opts = Options.from_mapping({"include": patterns, "min_tokens": min_tokens, "use_fast_accum": fast,
                                 "fuse_gelu": fuse})
    assert Options.from_mapping(opts.to_json()) == opts
    assert opts.include == tuple(p.strip() for p in patterns)
