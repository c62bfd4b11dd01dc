"""No traceback reaches a CLI user for a WorldFoundryError, and plugin options errors carry their JSON path."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from worldfoundry.bench.candidates import parse_candidates
from worldfoundry.cli import main as cli_main
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.errors import CandidateSchemaError
from worldfoundry.plugin import PluginOptions, number, option


def test_typed_error_from_any_command_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "boom_cmd.py").write_text(textwrap.dedent("""\
        from worldfoundry.errors import CheckpointError

        def add_parser(subparsers):
            p = subparsers.add_parser("boom")
            p.set_defaults(func=run)

        def run(args):
            raise CheckpointError("weights.safetensors: corrupt header; use an intact file")
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli_main.COMMANDS, "boom", "boom_cmd")
    assert cli_main.main(["boom"]) == 2
    err = capsys.readouterr().err
    assert err == "worldfoundry boom: error: weights.safetensors: corrupt header; use an intact file\n"


@dataclass(frozen=True)
class DemoOptions(PluginOptions):
    plugin_name: ClassVar[str] = "demo"
    scale: float = option(1.0, number(min=0.0, max=10.0))


class BrokenOptions:
    @classmethod
    def from_mapping(cls, mapping: Any) -> Any:
        return mapping["missing"]  # a plugin bug: KeyError


def _registry() -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("demo", lambda model, options, policy: None, options=DemoOptions)
    reg.register("broken", lambda model, options, policy: None, options=BrokenOptions)
    return reg


def _doc(plugin: str, options: dict) -> dict:
    return {"candidates": [{"name": "a", "accelerations": {plugin: options}}]}


@pytest.mark.parametrize("value", [-1, 11, 10**400, float("nan"), "x", True])
def test_registered_options_class_is_used_with_the_json_path(value) -> None:
    with pytest.raises(CandidateSchemaError) as info:
        parse_candidates(_doc("demo", {"scale": value}), registry=_registry())
    assert info.value.path == "candidates[0].accelerations.demo.scale"
    assert parse_candidates(_doc("demo", {"scale": 2}), registry=_registry()).candidates[0].name == "a"


def test_unknown_option_and_a_plugin_bug_are_typed() -> None:
    with pytest.raises(CandidateSchemaError, match=r"unknown option\(s\) \['colour'\]") as info:
        parse_candidates(_doc("demo", {"colour": 1}), registry=_registry())
    assert info.value.path == "candidates[0].accelerations.demo"
    with pytest.raises(CandidateSchemaError, match="broken refused these options .KeyError") as info:
        parse_candidates(_doc("broken", {}), registry=_registry())
    assert info.value.path == "candidates[0].accelerations.broken"
