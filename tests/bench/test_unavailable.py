"""A candidate naming an acceleration that is not installed is a ``rejected_at_install`` row, not a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worldfoundry.bench.harness import BenchConfig, run_bench
from worldfoundry.bench.unavailable import load_available
from worldfoundry.core.acceleration.registry import diffusion_acceleration_registry
from worldfoundry.errors import CandidateSchemaError

WORKLOAD = {"prompt": "a red square", "frames": 5, "height": 32, "width": 32, "steps": 2, "guidance": 5.0,
            "seeds": [1]}


def _file(tmp_path: Path, candidates: list[dict]) -> Path:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"workload": WORKLOAD, "candidates": candidates}))
    return path


def test_unknown_plugin_row_in_place(tmp_path: Path) -> None:
    path = _file(tmp_path, [
        {"name": "graph", "accelerations": {"not_installed_here": {"x": 1}}},
        {"name": "kv", "accelerations": {"wan_cross_kv_fusion": {"min_tokens": 0}}},
    ])
    results = run_bench(BenchConfig(model="tiny-wan2.1", candidates=str(path), out=str(tmp_path / "o"),
                                    quality_only=True, progress=False))
    rows = results["candidates"]
    assert [r["name"] for r in rows] == ["graph", "kv"]
    assert rows[0]["verdict"] == "rejected_at_install" and "not_installed_here" in rows[0]["error"]
    assert "known:" in rows[0]["error"] and rows[1]["verdict"] == "quality_only"
    assert "rejected_at_install" in (tmp_path / "o" / "report.md").read_text()


def test_file_with_nothing_runnable_is_an_error(tmp_path: Path) -> None:
    path = _file(tmp_path, [{"name": "g", "accelerations": {"not_installed_here": {}}}])
    with pytest.raises(CandidateSchemaError, match="no candidate can run here"):
        load_available(path, registry=diffusion_acceleration_registry())


def test_known_plugins_are_still_validated(tmp_path: Path) -> None:
    path = _file(tmp_path, [{"name": "e", "accelerations": {"easycache": {"threshold": "big"}}}])
    with pytest.raises(CandidateSchemaError, match=r"candidates\[0\].accelerations.easycache"):
        load_available(path, registry=diffusion_acceleration_registry())
