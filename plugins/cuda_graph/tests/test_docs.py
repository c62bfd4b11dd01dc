"""The Python example of docs/cuda_graph.md runs and prints what the page says."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_python_examples_run(capsys) -> None:  # noqa: ANN001
    page = (ROOT / "docs" / "cuda_graph.md").read_text()
    blocks = _BLOCK.findall(page)
    assert len(blocks) == 1
    for block in blocks:
        exec(compile(block, "docs/cuda_graph.md", "exec"), {})  # noqa: S102 - the page's own example
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == "{'capture': 1, 'replay': 3} [2]"
    assert f"prints `{printed}`" in page
