"""The Python examples in README.md, docs/models.md and docs/benchmarks.md run as written."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("page", ["README.md", "docs/models.md"])
def test_python_examples_run(page: str, monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    blocks = _BLOCK.findall((ROOT / page).read_text())
    assert blocks, f"{page} has no python example"
    module = types.ModuleType("docs_example_" + re.sub(r"\W", "_", page))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page}[python block {i}]", "exec"), module.__dict__)
    out = capsys.readouterr().out
    if page == "README.md":
        assert "(9, 32, 32, 3) {'computed': 24}" in out
        assert "True {'computed': 8}" in out  # the diffusers-pipeline example
    else:
        assert "torch.Size([1, 16, 2, 4, 4]) (5, 32, 32, 3) True" in out


def test_candidate_schema_example_in_benchmarks_doc_is_valid() -> None:
    import json

    from worldfoundry.bench.candidates import parse_candidates
    from worldfoundry.core.acceleration.registry import diffusion_acceleration_registry

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    block = re.search(r"^```json\n(.*?)^```", text, re.S | re.M).group(1)
    parsed = parse_candidates(json.loads(block), registry=diffusion_acceleration_registry())
    assert [c.name for c in parsed.candidates] == ["exact-mha", "cache"]
