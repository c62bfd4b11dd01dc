"""The Python examples of docs/resident_blocks.md and docs/zh/resident_blocks.md run and print what the pages
say; the baseline and resident launch scripts agree on everything but the config."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from worldfoundry_resident_blocks.options import Options

from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV

ROOT = Path(__file__).resolve().parents[3]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
EXPECTED = ["10 [0, 3, 6, 9, 12, 15, 18, 21, 24, 27] 9", "[0] [1, 1, 1, 1, 1, 1] True", "(2, 2) ((1, 0), (3, 1)) 1"]


@pytest.mark.parametrize("page", ["docs/resident_blocks.md", "docs/zh/resident_blocks.md"])
def test_python_examples_run(page: str, monkeypatch, capsys) -> None:
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)
    text = (ROOT / page).read_text()
    blocks = _BLOCK.findall(text)
    assert len(blocks) == 3
    module = types.ModuleType("docs_example_resident_blocks")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page}[python block {i}]", "exec"), module.__dict__)
    printed = capsys.readouterr().out.splitlines()
    assert printed == EXPECTED
    for line in EXPECTED:
        assert f"`{line}`" in text  # the page states what the example prints


def test_pages_link_each_other() -> None:
    assert "(zh/resident_blocks.md)" in (ROOT / "docs/resident_blocks.md").read_text()
    assert "(../resident_blocks.md)" in (ROOT / "docs/zh/resident_blocks.md").read_text()


def _assignments(script: Path) -> dict[str, str]:
    return dict(re.findall(r"^(\w+)=(.*)$", script.read_text(), re.M))


def test_scripts_share_the_request_and_parse() -> None:
    base = ROOT / "benchmarks/offload/run_baseline.sh"
    resident = ROOT / "benchmarks/offload/run_resident.sh"
    for script in (base, resident):
        subprocess.run(["bash", "-n", str(script)], check=True)
    a, b = _assignments(base), _assignments(resident)
    shared = ("checkpoint_dir", "recipe", "device", "dtype", "prompt", "frames", "height", "width", "steps", "seed")
    assert {k: a[k] for k in shared} == {k: b[k] for k in shared}
    assert a["config"] != b["config"] and a["output"] != b["output"]
    assert "--contiguous" not in resident.read_text()  # the estimate uses the baseline's per-tensor layout


def test_baseline_config_is_r_zero() -> None:
    path = ROOT / "recipes/residency/baseline.json"
    assert json.loads(path.read_text()) == {"offload_resident_blocks": 0, "cpu_offload_block_contiguous": False}
    opts = Options.from_mapping({"config": str(path)})
    assert opts.offload_resident_blocks == 0 and opts.cpu_offload_block_contiguous is False
