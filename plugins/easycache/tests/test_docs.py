"""The Python examples in docs/easycache.md run as written and print what the page says."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "easycache.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_python_examples_run(capsys):
    text = DOC.read_text()
    blocks = _BLOCK.findall(text)
    assert len(blocks) == 3
    namespace: dict[str, object] = {"__name__": "docs_easycache"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"easycache.md[python block {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "{'threshold': 0.05, 'warmup_steps': 10, 'final_dense_steps': 1, 'branch_decision': 'cond'}" in out
    assert "CCSSSC {'steps': 6}" in out and "`CCSSSC {'steps': 6}`" in text
    assert "CCSSC {'computed': 3, 'skipped_steps': 2}" in out
    assert "`CCSSC {'computed': 3, 'skipped_steps': 2}`" in text
