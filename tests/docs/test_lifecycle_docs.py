"""The Python examples in docs/architecture.md and docs/plugins.md run as written."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV

DOCS = Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("page", ["architecture.md", "plugins.md"])
def test_python_examples_run(page, monkeypatch, capsys):
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)
    blocks = _BLOCK.findall((DOCS / page).read_text())
    assert blocks, f"{page} has no python example"
    module = types.ModuleType(f"docs_example_{page.replace('.', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look their module up
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page}[python block {i}]", "exec"), module.__dict__)
    out = capsys.readouterr().out
    if page == "architecture.md":
        assert "cannot uninstall accelerations" in out and "'r1'" in out
        assert '{"proj_out": {"kernel": 1}}' in out
    else:
        assert "{'blocks.0.ffn.net.2': {'fp32_linear': 1}, 'blocks.1.ffn.net.2': {'fp32_linear': 1}} []" in out
        assert "('example_gelu_tanh',)" in out
        printed = re.search(r"^prints\n\n```text\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M).group(1)
        assert printed in out  # the output the page shows is the output the example gives


def test_plugin_page_excerpts_are_the_example_distribution() -> None:
    """Every ``py`` block of plugins.md headed by a file path stands in that file verbatim."""
    root = DOCS.parent
    excerpts = re.findall(r"^```py\n# (\S+)\n(.*?)^```", (DOCS / "plugins.md").read_text(), re.S | re.M)
    assert len(excerpts) >= 6
    for path, text in excerpts:
        assert text in (root / path).read_text(), f"plugins.md quotes {path} but the file no longer says:\n{text}"
