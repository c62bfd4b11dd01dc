"""The Python examples of docs/diffusers.md run in order and print what the page says."""

from __future__ import annotations

import re
from pathlib import Path

from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "diffusers.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_TEXT = re.compile(r"^```text\n(.*?)^```", re.S | re.M)


def test_python_examples_run_and_print_what_the_page_says(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)
    text = PAGE.read_text()
    blocks = _BLOCK.findall(text)
    assert len(blocks) == 3
    namespace: dict = {}
    outputs = []
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/diffusers.md[{i}]", "exec"), namespace)  # noqa: S102 - the page's examples
        outputs.append(capsys.readouterr().out.strip())
    assert outputs[0] == _TEXT.findall(text)[0].strip()
    assert outputs[1] == "clip-0001 ['clip-0001']"
    assert outputs[2] == "True True True"
