"""The Python example of docs/block_fusion.md runs and prints what the page says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV

ROOT = Path(__file__).resolve().parents[3]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_python_example_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kernels) -> None:
    if kernels.type != "cpu":  # the page's example runs its tiny model on the CPU, under Triton's interpreter
        pytest.skip("the docs example runs on the CPU under TRITON_INTERPRET=1; the GPU paths are test_gpu.py's")
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)
    blocks = _BLOCK.findall((ROOT / "docs" / "block_fusion.md").read_text())
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/block_fusion.md", "exec"), {})  # noqa: S102 - the page's own example
    assert capsys.readouterr().out.strip().splitlines()[-1] == "True 4 {}"
