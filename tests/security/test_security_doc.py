"""The examples in docs/security.md run as written, and the page stays linked from the README."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_security_doc_examples_run(capsys) -> None:
    page = ROOT / "docs" / "security.md"
    blocks = _BLOCK.findall(page.read_text())
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/security.md[python block {i}]", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["WanTransformer3DModel", "ClassNotAllowedError"]
    assert out[2] == "$.steps duplicate key 'steps' (a JSON object names each key once)"
    assert out[3] == "$.guidance Infinity is not allowed (JSON numbers must be finite)"
    assert out[4].startswith("$ nesting deeper than 64 levels")


def test_security_doc_is_linked_and_names_real_error_types() -> None:
    import worldfoundry.errors as errors

    assert "`docs/security.md`" in (ROOT / "README.md").read_text()
    text = (ROOT / "docs" / "security.md").read_text()
    named = set(re.findall(r"`([A-Z][A-Za-z]+Error)`", text))
    assert {"ClassNotAllowedError", "CheckpointKeysError", "CalibrationArtifactError"} <= named
    assert all(isinstance(getattr(errors, name, None), type) for name in named), named
