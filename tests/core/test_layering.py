"""Core is plugin-neutral: it names no plugin and imports nothing from the model layer or a plugin distribution.

Plugin-specific knowledge (file names, option keys, spec names) lives in the plugin's distribution or is
passed in; model-family knowledge lives in ``worldfoundry.base_models`` and is handed down as parameters.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "worldfoundry" / "core"
PLUGIN_SOURCES = sorted((ROOT / "plugins").glob("*/src/worldfoundry_*")) + sorted(
    (ROOT / "docs" / "examples").glob("*/src/worldfoundry_*"))


#: Names of numerical methods that a plugin is also named after. Core holds the method's numerics (the
#: architecture puts SVDQuant's in ``core/acceleration/quantization``) and may name the method; it still holds no
#: option keys, file names or spec handling of the plugin.
METHOD_NAMES = frozenset({"svdquant"})


def _plugin_names() -> set[str]:
    names = {ep.name for ep in importlib.metadata.entry_points(group="worldfoundry.accelerations")}
    names |= {path.name.removeprefix("worldfoundry_") for path in PLUGIN_SOURCES}
    return names - METHOD_NAMES


def _model_layer_option_keys() -> frozenset[str]:
    from worldfoundry.base_models.runtime_options import MODEL_LAYER_OPTION_KEYS

    return MODEL_LAYER_OPTION_KEYS


def _core_files() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def test_the_plugin_list_is_not_empty() -> None:
    assert {"easycache", "resident_blocks", "lightvae", "optimized_mha"} <= _plugin_names()
    assert len(_core_files()) > 20


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(CORE)))
def test_core_names_no_plugin(path: Path) -> None:
    text = path.read_text()
    found = sorted(name for name in _plugin_names() if re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w])", text))
    assert not found, f"{path.relative_to(ROOT)} names plugin(s) {found}; move that knowledge into the plugin"


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(CORE)))
def test_core_imports_nothing_above_it(path: Path) -> None:
    tree = ast.parse(path.read_text())
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    upward = sorted(m for m in modules if m.startswith(("worldfoundry.base_models", "worldfoundry_",
                                                       "worldfoundry.plugin", "worldfoundry.cli",
                                                       "worldfoundry.bench")))
    assert not upward, f"{path.relative_to(ROOT)} imports {upward}; hand that knowledge down as a parameter"


def test_model_layer_option_keys_are_declared_to_core() -> None:
    from worldfoundry.core.model_loading.runtime_options import declared_runtime_options

    assert "vae_fp8_calibration" in _model_layer_option_keys()
    assert _model_layer_option_keys() <= set(declared_runtime_options())


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(CORE)))
def test_core_names_no_model_layer_option(path: Path) -> None:
    text = path.read_text()
    found = sorted(key for key in _model_layer_option_keys() if re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", text))
    assert not found, f"{path.relative_to(ROOT)} names model-layer option(s) {found}; declare them from the model layer"


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(CORE)))
def test_core_names_no_model_layer_module(path: Path) -> None:
    """Not even as a string that ``importlib`` would load later: the model layer registers what core may load."""
    found = re.findall(r"worldfoundry\.base_models[\w.]*", path.read_text())
    assert not found, f"{path.relative_to(ROOT)} names {sorted(set(found))}; register it from the model layer"


def test_model_layer_classes_are_registered_to_core() -> None:
    from worldfoundry.base_models.runtime_options import MODEL_LAYER_CLASSES
    from worldfoundry.core.model_loading.class_allowlist import PROJECT_CLASSES, register_project_class, resolve_class

    assert MODEL_LAYER_CLASSES.items() <= PROJECT_CLASSES.items()
    reference = "worldfoundry.base_models.diffusion_model.patch_codec.PixelPatchCodec"
    assert resolve_class(reference, recipe="r", component="codec").__name__ == "PixelPatchCodec"
    with pytest.raises(ValueError, match="project classes live in the worldfoundry package"):
        register_project_class("os.system", "os", "system")
    with pytest.raises(ValueError, match="already registered"):
        register_project_class(reference, "worldfoundry.elsewhere", "PixelPatchCodec")
