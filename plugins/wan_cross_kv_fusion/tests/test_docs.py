"""The Python examples of docs/wan_cross_kv_fusion.md run and print what the page says."""

from __future__ import annotations

import re
from pathlib import Path

from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV

ROOT = Path(__file__).resolve().parents[3]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_python_examples_run(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)
    blocks = _BLOCK.findall((ROOT / "docs" / "wan_cross_kv_fusion.md").read_text())
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, "docs/wan_cross_kv_fusion.md", "exec"), {})  # noqa: S102 - the page's own examples
    assert capsys.readouterr().out.strip().splitlines()[-1] == "4 2"
