"""Hostile inputs shared by the security tests: the recipe that once ran a shell command, and a candidate file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

#: The exploit: ``class: builtins.exec`` with ``config_class: builtins.str`` turns the config into a Python program
#: (``exec(str(object=...))``) that writes a marker file.
EXPLOIT_RECIPE = """\
name: {name}
family: wan
offline: true
components:
  denoiser:
    class: builtins.exec
    config_class: builtins.str
    config: {{object: "open({marker!r}, 'w').write('code ran')"}}
  scheduler: {{class: diffusers.FlowMatchEulerDiscreteScheduler, config: {{}}}}
"""


def _exploit_recipe(directory: Path, name: str, marker: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(EXPLOIT_RECIPE.format(name=name, marker=str(marker)))
    return path


def _candidate_document(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": "tiny-wan2.1",
        "workload": {"prompt": "a red ball", "frames": 5, "height": 32, "width": 32, "steps": 2, "guidance": 5.0,
                     "shift": 3.0, "seeds": [1]},
        "quality_budget": {"latent_rel_l2": 0.03, "psnr_db": 33.0, "min_ssim": 0.98},
        "candidates": [{"name": "ec", "accelerations": {"easycache": {"threshold": 0.0}}}],
    }
    doc.update(changes)
    return doc


def _write_json(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def exploit_recipe():
    """``exploit_recipe(directory, name, marker)`` writes the exploit recipe whose code, if run, creates ``marker``."""
    return _exploit_recipe


@pytest.fixture
def candidate_document():
    """``candidate_document(**changes)``: a valid candidate file for tiny-wan2.1 (temporal stride 4, spatial 8 × patch 2)."""
    return _candidate_document


@pytest.fixture
def write_json():
    """``write_json(path, doc)`` writes ``doc`` as JSON and returns the path."""
    return _write_json


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """The file the exploit would create; every test asserts it does not exist afterwards."""
    return tmp_path / "MARKER-code-ran"
