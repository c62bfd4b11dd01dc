"""The Python examples in docs/attention.md run as written and print what the page says; the candidate file parses."""

from __future__ import annotations

import re
from pathlib import Path

from worldfoundry.bench.candidates import load_candidates
from worldfoundry.core.acceleration.registry import AccelerationRegistry

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "attention.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_python_examples_run(capsys) -> None:  # noqa: ANN001
    text = DOC.read_text()
    blocks = _BLOCK.findall(text)
    assert len(blocks) == 3
    namespace: dict[str, object] = {"__name__": "docs_attention"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"attention.md[python block {i}]", "exec"), namespace)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["float64 supports dtypes ['float32', 'bfloat16'], not float16", "None",
                     "{'float64': 2, 'dense_fallback': 2}", "{'text_cross: below min_tokens': 2}", "exact_equivalent"]
    flat = text.replace("\n", " ")
    for line in lines:
        assert f"`{line}`" in flat, line


def test_the_candidate_file_parses() -> None:
    registry = AccelerationRegistry(allowlist=["attention_policy", "wan_cross_kv_fusion"])
    candidates = load_candidates(ROOT / "recipes" / "candidates" / "attention-h200.json", registry=registry)
    names = [c.name for c in candidates.candidates]
    assert names[0] == "fa3-self" and "sage-self" in names
