"""``svdquant`` options: defaults, typed errors naming the JSON path, no model needed."""

from __future__ import annotations

import pytest
from worldfoundry_svdquant.options import Options
from worldfoundry_svdquant.plugin import prepare

from worldfoundry.errors import AccelerationOptionsError


def test_defaults_and_json():
    opts = Options.from_mapping({"artifact": "a.json"})
    assert (opts.include, opts.keep_original, opts.backend) == (None, "device", "auto")
    assert opts.to_json() == {"artifact": "a.json", "include": None, "keep_original": "device", "backend": "auto",
                              "fast_accum": True, "fuse_gelu": True, "one_launch_operand": False,
                              "activation_group": None}
    assert prepare.options_class is Options


@pytest.mark.parametrize("spec,match", [
    ({}, "artifact: required"),
    ({"artifact": ""}, "artifact: expected a non-empty string"),
    ({"artifact": "a", "keep_original": "host"}, r"keep_original: expected one of \['device', 'cpu'\]"),
    ({"artifact": "a", "backend": "w4a4"}, "backend: expected one of"),
    ({"artifact": "a", "include": "blocks.*"}, "include: expected a list"),
    ({"artifact": "a", "fast_accum": "yes"}, "fast_accum: expected true/false"),
    ({"artifact": "a", "one_launch_operand": 1}, "one_launch_operand: expected true/false"),
    ({"artifact": "a", "include": []}, "include: expected a list of 1 to"),
    ({"artifact": "a", "rank": 4}, r"unknown option\(s\) \['rank'\]"),
    ({"artifact": "a", "backend": "reference", "activation_group": 100}, "activation_group: expected 64, 128 or 256"),
    ({"artifact": "a", "activation_group": 64}, "activation_group: runs on backend reference or w4a8"),
    ({"artifact": "a", "backend": "w4f8", "activation_group": 64}, "not 'w4f8'; set backend: reference"),
])
def test_bad_options_name_the_path(spec, match):
    with pytest.raises(AccelerationOptionsError, match=match) as info:
        Options.from_mapping(spec, path="accelerations.svdquant")
    assert info.value.path.startswith("accelerations.svdquant")
