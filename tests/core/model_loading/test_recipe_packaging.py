"""A wheel install carries every built-in recipe file (pyproject's data-files cover the recipes/ tree)."""

from __future__ import annotations

import fnmatch
import sysconfig
import tomllib
from pathlib import Path

import pytest

from worldfoundry.core.model_loading import recipes

ROOT = Path(__file__).resolve().parents[3]


def test_data_files_cover_every_recipe_file() -> None:
    pyproject = ROOT / "pyproject.toml"
    if not (ROOT / "recipes").is_dir() or not pyproject.is_file():
        pytest.skip("not a source checkout")
    data_files = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["data-files"]
    patterns = [pattern for globs in data_files.values() for pattern in globs]
    files = [p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").rglob("*") if p.is_file()]
    assert files

    def covered(path: str) -> bool:  # same directory, basename matches (setuptools globs do not recurse)
        folder, name = path.rsplit("/", 1)
        return any(pat.rsplit("/", 1)[0] == folder and fnmatch.fnmatchcase(name, pat.rsplit("/", 1)[1])
                   for pat in patterns)

    missing = [f for f in files if not covered(f)]
    assert missing == [], f"recipe files a wheel would not carry (add them to [tool.setuptools.data-files]): {missing}"
    for target, globs in data_files.items():
        for pattern in globs:  # each file lands in the directory mirroring its source directory
            assert target == "share/worldfoundry/" + pattern.rsplit("/", 1)[0]


def test_wheel_locations_are_searched(tmp_path, monkeypatch) -> None:
    installed = tmp_path / "share" / "worldfoundry" / "recipes"
    installed.mkdir(parents=True)
    (installed / "only-in-wheel.yaml").write_text("family: wan\n")
    monkeypatch.setattr(sysconfig, "get_path", lambda name, scheme=None: str(tmp_path))
    assert installed in recipes.installed_recipe_dirs()
    assert "only-in-wheel" in recipes.available_recipes()
