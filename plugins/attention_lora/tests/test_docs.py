"""The Python examples in docs/attention_lora.md run as written (in order, one namespace)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "attention_lora.md"


def test_documented_examples_run(capsys) -> None:
    if not DOC.is_file():
        pytest.skip("docs are not part of this checkout")
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    printed = capsys.readouterr().out.split()
    assert "dit_only" in printed and "fp32" in printed
    file_digest = hashlib.sha256(Path(namespace["path"]).read_bytes()).hexdigest()
    assert namespace["adapter"]["sha256"] == file_digest and namespace["adapter"]["identity_kind"] == "file_sha256"
    assert namespace["record"].options["identity_kind"] == "state_dict_sha256"
