"""The Python examples of docs/svdquant.md run (all but the configuration fragment) and print or assert what the
page says."""

from __future__ import annotations

import re
from pathlib import Path

from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV

ROOT = Path(__file__).resolve().parents[3]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[str]:
    """The page's Python blocks, the low-rank refinement example (the calibration section's first) and the
    one-pass producer's left out."""
    blocks = [b for b in _BLOCK.findall((ROOT / "docs" / "svdquant.md").read_text()) if "row_max=row_max" not in b]
    assert "refine=3" in blocks[0]
    return blocks[1:]


def test_single_pass_producer_example_runs() -> None:
    """The one-pass GELU producer's row magnitudes, as the page states them (asserts inside)."""
    block = next(b for b in _BLOCK.findall((ROOT / "docs" / "svdquant.md").read_text()) if "row_max=row_max" in b)
    exec(compile(block, "docs/svdquant.md", "exec"), {})  # noqa: S102 - the page's own example


def test_refinement_example_runs() -> None:
    block = next(b for b in _BLOCK.findall((ROOT / "docs" / "svdquant.md").read_text()) if "refine=3" in b)
    exec(compile(block, "docs/svdquant.md", "exec"), {})  # noqa: S102 - the page's own example (asserts inside)


def test_python_example_runs(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)
    blocks = _blocks()
    assert len(blocks) == 4 and "RuntimePolicy(" in blocks[3]
    exec(compile(blocks[0], "docs/svdquant.md", "exec"), {})  # noqa: S102 - the page's own example
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2] == "[('backend_reason: cpu device', 4), ('reference', 4)]"
    assert lines[-1].endswith("relative L2") and float(lines[-1].split()[0]) < 0.05


def test_per_channel_example_runs(capsys) -> None:  # noqa: ANN001
    blocks = _blocks()
    exec(compile(blocks[1], "docs/svdquant.md", "exec"), {})  # noqa: S102 - the page's own example
    shapes, result = capsys.readouterr().out.strip().splitlines()[-2:]
    assert shapes == "(1, 64) (64, 128)"
    assert result.startswith("reference ") and result.endswith("relative L2") and float(result.split()[1]) < 0.15


def test_w4f8_example_runs(capsys) -> None:  # noqa: ANN001
    blocks = _blocks()
    assert "w4f8_linear_reference" in blocks[2]
    exec(compile(blocks[2], "docs/svdquant.md", "exec"), {})  # noqa: S102 - the page's own example
    result = capsys.readouterr().out.strip().splitlines()[-1]
    assert result.endswith("relative L2") and float(result.split()[0]) < 0.15
