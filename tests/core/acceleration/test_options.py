"""The options base: typed, bounded checks; unknown, missing and bad keys named by JSON path; frozen; JSON form."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import ClassVar

import pytest

from worldfoundry.errors import AccelerationOptionsError
from worldfoundry.plugin import (
    OptionValueError,
    PluginOptions,
    any_of,
    boolean,
    choice,
    file_path,
    integer,
    nested,
    number,
    option,
    optional,
    sequence_of,
    shown_value,
    string,
)


@dataclasses.dataclass(frozen=True)
class Inner(PluginOptions):
    plugin_name: ClassVar[str] = "demo"

    size: int = option(1, integer(min=1, max=8))


@dataclasses.dataclass(frozen=True)
class Demo(PluginOptions):
    plugin_name: ClassVar[str] = "demo"

    scale: float = option(1.0, number(min=0.0, max=2.0))
    steps: int = option(3, integer(min=0))
    mode: str = option("fast", choice("fast", "exact"))
    flag: bool = option(False, boolean())
    name: str | None = option(None, optional(string()))
    blocks: tuple[int, ...] = option((), sequence_of(integer(min=0), unique=True))
    inner: Inner = option(default_factory=Inner, check=nested(Inner))
    path: str | None = option(None, optional(file_path()))

    def validate(self) -> None:
        if self.mode == "exact" and self.scale != 1.0:
            raise OptionValueError("scale", "must be 1 when mode is 'exact'")


@dataclasses.dataclass(frozen=True)
class MustBe(PluginOptions):
    plugin_name: ClassVar[str] = "worded"
    error_format: ClassVar[str] = "{path} must be {expected}, got {value}"

    count: int = option(check=integer(min=0))


def test_defaults_frozen_and_json() -> None:
    opts = Demo.from_mapping(None)
    assert opts == Demo() and Demo.from_mapping({}) == opts
    assert opts.to_json() == {"scale": 1.0, "steps": 3, "mode": "fast", "flag": False, "name": None, "blocks": [],
                              "inner": {"size": 1}, "path": None}
    assert Demo.from_mapping(opts.to_json()) == opts
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.scale = 2.0  # type: ignore[misc]
    normalised = Demo.from_mapping({"scale": 2, "blocks": [3, 1], "inner": {"size": 4}, "path": Path("a.pt")})
    assert normalised.scale == 2.0 and isinstance(normalised.scale, float)
    assert normalised.blocks == (3, 1) and normalised.inner == Inner(4) and normalised.path == os.fspath("a.pt")


@pytest.mark.parametrize(("values", "path", "fragment"), [
    ({"scale": -1}, "scale", "scale: expected a finite number >= 0 and <= 2, got -1"),
    ({"scale": math.nan}, "scale", "got nan"),
    ({"scale": 10**400}, "scale", "an integer of 1329 bits"),
    ({"scale": 1e308 * 10}, "scale", "got inf"),
    ({"steps": True}, "steps", "expected an integer >= 0, got True"),
    ({"steps": 2**63}, "steps", "an integer >= 0"),
    ({"steps": 10**400}, "steps", "an integer of"),
    ({"mode": "slow"}, "mode", "expected one of ['fast', 'exact'], got 'slow'"),
    ({"mode": 3}, "mode", "expected a string, one of ['fast', 'exact']"),
    ({"flag": 1}, "flag", "expected true or false, got 1"),
    ({"name": ""}, "name", "a non-empty string"),
    ({"name": "a\x00b"}, "name", "a non-empty string"),
    ({"name": "x" * 5000}, "name", "..."),
    ({"blocks": "01"}, "blocks", "expected a list"),
    ({"blocks": [1, 1]}, "blocks", "lists an item twice"),
    ({"blocks": [0, -2]}, "blocks[1]", "blocks[1]: expected an integer >= 0, got -2"),
    ({"inner": {"size": 9}}, "inner.size", "inner.size: expected an integer in [1, 8], got 9"),
    ({"inner": {"sise": 1}}, "inner", "unknown option(s) ['sise'] in 'inner'"),
    ({"inner": [1]}, "inner", "'inner' must be a mapping"),
    ({"path": 3}, "path", "a non-empty file path"),
    ({"mode": "exact", "scale": 0.5}, "scale", "scale: must be 1 when mode is 'exact'"),
])
def test_bad_values_name_their_path(values: dict, path: str, fragment: str) -> None:
    with pytest.raises(AccelerationOptionsError) as info:
        Demo.from_mapping(values)
    assert info.value.plugin == "demo" and info.value.path == path
    assert fragment in str(info.value)


def test_paths_are_prefixed_with_the_spec_location() -> None:
    where = "candidates[2].accelerations.demo"
    with pytest.raises(AccelerationOptionsError) as info:
        Demo.from_mapping({"inner": {"size": 0}}, path=where)
    assert info.value.path == f"{where}.inner.size"
    with pytest.raises(AccelerationOptionsError) as info:
        Demo.from_mapping({"mode": "exact", "scale": 0.5}, path=where)
    assert info.value.path == f"{where}.scale"
    with pytest.raises(AccelerationOptionsError, match=r"unknown option\(s\) \['x'\] in 'candidates"):
        Demo.from_mapping({"x": 1}, path=where)


def test_unknown_missing_and_non_mapping() -> None:
    with pytest.raises(AccelerationOptionsError, match=r"^demo: unknown option\(s\) \['sclae'\]; known options: \["):
        Demo.from_mapping({"sclae": 1})
    with pytest.raises(AccelerationOptionsError, match=r"unknown option\(s\) \['1'\]"):
        Demo.from_mapping({1: 2})
    with pytest.raises(AccelerationOptionsError, match=r"missing required option\(s\) \['count'\]"):
        MustBe.from_mapping({})
    with pytest.raises(AccelerationOptionsError, match="options must be a mapping; expected a mapping"):
        Demo.from_mapping([("scale", 1)])  # type: ignore[arg-type]


def test_the_other_wording() -> None:
    with pytest.raises(AccelerationOptionsError, match=r"^worded: count must be an integer >= 0, got -1$"):
        MustBe.from_mapping({"count": -1})


def test_checks_alone() -> None:
    assert any_of(integer(), string(), expected="an integer or a name")(3, "x") == 3
    assert any_of(integer(), string(), expected="an integer or a name")("a", "x") == "a"
    with pytest.raises(OptionValueError, match="x: expected an integer or a name, got 1.5"):
        any_of(integer(), string(), expected="an integer or a name")(1.5, "x")
    with pytest.raises(OptionValueError, match=r"x: expected a list of 1 to 2 items"):
        sequence_of(integer(), min_items=1, max_items=2)([], "x")
    with pytest.raises(OptionValueError, match="x: expected in range"):
        number(min=0, expected="in range", type_expected="a number")(-1, "x")
    with pytest.raises(OptionValueError, match="x: expected a number, got 'a'"):
        number(min=0, expected="in range", type_expected="a number")("a", "x")
    assert number(min=0.0, min_exclusive=True)(1e-9, "x") == 1e-9
    with pytest.raises(OptionValueError):
        number(min=0.0, min_exclusive=True)(0, "x")
    assert string(min_length=2, max_length=3)("abc", "x") == "abc"


def test_shown_value_is_short_and_safe() -> None:
    class Hostile:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert shown_value(Hostile()) == "<Hostile>"
    assert shown_value(10**100) == "an integer of 333 bits"
    assert len(shown_value("y" * 1000)) == 80
