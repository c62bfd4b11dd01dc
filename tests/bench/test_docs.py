"""The Python examples of docs/benchmarks.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_benchmarks_doc_examples_run(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    blocks = _BLOCK.findall((ROOT / "docs" / "benchmarks.md").read_text())
    assert len(blocks) == 2
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"benchmarks.md[python block {i}]", "exec"), namespace)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "3 target 2.0 paired_median"
    assert out[1] == "step_floor 2.0 [2.0, 2.0] 3.0"
    assert out[2] == "1.6 True"
    assert out[3].startswith("NOISY HOST: dense-vs-dense noise floor 1.900 > 1.050")
    assert out[4] == "timing True"
    assert (tmp_path / "tune_doc" / "tuned.json").is_file()
