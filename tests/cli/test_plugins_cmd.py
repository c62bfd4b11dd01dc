"""``worldfoundry plugins`` and the command table of ``worldfoundry.cli.main``."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from worldfoundry.cli import plugins_cmd
from worldfoundry.cli.main import COMMANDS, build_parser, main
from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV, AccelerationRegistry

EXAMPLE = "example_gelu_tanh"
EXAMPLE_DIST = "worldfoundry-example-gelu-tanh"


@pytest.fixture(autouse=True)
def _all_plugins(monkeypatch):
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)


def test_table_lists_the_example_plugin(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    header, rule, *rows = out.splitlines()
    assert header.split() == ["name", "distribution", "version", "entry", "point", "status"]
    row = next(r for r in rows if r.startswith(EXAMPLE + " "))
    assert EXAMPLE_DIST in row and "0.1.0" in row and "worldfoundry_example_gelu_tanh.plugin" in row
    assert row.rstrip().endswith("loaded")


def test_json_output(capsys):
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["group"] == "worldfoundry.accelerations"
    row = next(r for r in data["plugins"] if r["name"] == EXAMPLE)
    assert row == {"name": EXAMPLE, "distribution": EXAMPLE_DIST, "version": "0.1.0",
                   "entry_point": f"{EXAMPLE} = worldfoundry_example_gelu_tanh.plugin", "status": "loaded",
                   "error": None}


def test_failed_and_skipped_plugins_are_shown_with_their_errors(tmp_path, monkeypatch):
    tag = uuid.uuid4().hex[:8]
    module = f"wf_cli_broken_{tag}"
    (tmp_path / f"{module}.py").write_text("raise ImportError('the CUDA extension is missing')\n")
    info = tmp_path / f"wf_cli_broken_{tag}-2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: wf-cli-broken-{tag}\nVersion: 2.0\n")
    (info / "entry_points.txt").write_text(f"[worldfoundry.accelerations]\nbroken_{tag} = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = AccelerationRegistry()
    out = io.StringIO()
    args = argparse.Namespace(json=False, strict=False)
    assert plugins_cmd.run(args, registry=registry, out=out) == 0
    text = out.getvalue()
    assert f"wf-cli-broken-{tag}" in text and "failed" in text
    assert f"wf-cli-broken-{tag} (broken_{tag} = {module}): ImportError: the CUDA extension is missing" in text
    assert EXAMPLE in text  # the others still load
    assert plugins_cmd.run(argparse.Namespace(json=False, strict=True), registry=registry, out=io.StringIO()) == 1

    monkeypatch.setenv(PLUGIN_ALLOWLIST_ENV, "")
    rows = plugins_cmd.plugin_rows(AccelerationRegistry())
    assert rows and all(r["status"] == f"skipped (not in {PLUGIN_ALLOWLIST_ENV})" for r in rows)


def test_code_registered_names_and_empty_listing():
    registry = AccelerationRegistry(discover=False)
    assert "no acceleration plugins found" in plugins_cmd.format_table(plugins_cmd.plugin_rows(registry))
    registry.register("in_code", lambda model, options, policy: None)
    rows = plugins_cmd.plugin_rows(registry)
    assert rows == [{"name": "in_code", "distribution": "-", "version": "-", "entry_point": "(code)",
                     "status": "loaded", "error": None}]


def test_command_table_dispatch_and_broken_command(capsys):
    assert COMMANDS["plugins"] == "worldfoundry.cli.plugins_cmd"
    parser = build_parser({"plugins": "worldfoundry.cli.plugins_cmd", "ghost": "worldfoundry.cli.no_such_module"})
    args, extra = parser.parse_known_args(["ghost", "--anything"])
    assert extra == ["--anything"] and args.func(args) == 2
    assert "cannot load worldfoundry.cli.no_such_module" in capsys.readouterr().err
    args = parser.parse_args(["plugins", "--json"])
    assert args.func is plugins_cmd.run and args.json is True


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "plugins" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["plugins", "--no-such-flag"])
    assert info.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0


def test_console_script_lists_the_example_plugin():
    env = {k: v for k, v in os.environ.items() if k != PLUGIN_ALLOWLIST_ENV}
    code = textwrap.dedent("""
        import sys
        from importlib.metadata import entry_points
        (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "worldfoundry"]
        sys.exit(script.load()(["plugins", "--json"]))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert any(r["name"] == EXAMPLE for r in json.loads(result.stdout)["plugins"])
