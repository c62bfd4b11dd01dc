"""The Python example of docs/block_fusion.md runs and prints what the page says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV

ROOT = Path(__file__).resolve().parents[3]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.usefixtures("kernels")
def test_python_example_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)
    blocks = _BLOCK.findall((ROOT / "docs" / "block_fusion.md").read_text())
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/block_fusion.md", "exec"), {})  # noqa: S102 - the page's own example
    assert capsys.readouterr().out.strip().splitlines()[-1] == "True 4 {}"
