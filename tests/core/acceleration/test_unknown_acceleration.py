"""The unknown-acceleration error says what to install: the built-in distribution, or the allowlist that skipped it."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from worldfoundry.core.acceleration.registry import AccelerationRegistry, bundled_distribution
from worldfoundry.errors import UnknownAccelerationError

ROOT = Path(__file__).resolve().parents[3]


def test_a_builtin_name_without_its_distribution_names_the_distribution():
    reg = AccelerationRegistry(discover=False)
    with pytest.raises(UnknownAccelerationError) as info:
        reg.get("optimized_mha")
    message = str(info.value)
    assert info.value.distribution == "worldfoundry-optimized-mha"
    assert "(none registered)" in message and "pip install worldfoundry-optimized-mha" in message
    assert 'pip install "worldfoundry[all]"' in message and "\n" not in message


def test_an_unknown_third_party_name_says_to_install_its_distribution():
    reg = AccelerationRegistry(discover=False)
    with pytest.raises(UnknownAccelerationError, match="Install the distribution that provides it") as info:
        reg.get("someone_elses_kernel")
    assert info.value.distribution is None


def test_a_name_skipped_by_the_allowlist_says_so():
    installed = {ep.name for ep in importlib.metadata.entry_points(group="worldfoundry.accelerations")}
    if "easycache" not in installed:
        pytest.skip("worldfoundry-easycache is not installed here")
    reg = AccelerationRegistry(allowlist=[])
    with pytest.raises(UnknownAccelerationError, match="not in WORLDFOUNDRY_PLUGINS") as info:
        reg.get("easycache")
    assert info.value.skipped_by_allowlist


def test_the_table_matches_the_plugin_distributions_and_the_all_extra():
    tomllib = pytest.importorskip("tomllib")
    if not (ROOT / "plugins").is_dir():
        pytest.skip("not a checkout")
    found, distributions = {}, set()
    for pyproject in sorted(ROOT.glob("plugins/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        distributions.add(project["name"])
        for name in project["entry-points"].get("worldfoundry.accelerations", {}):
            found[name] = project["name"]
    assert all(dist == "worldfoundry-" + name.replace("_", "-") or name.startswith(("wan_", "sana_"))
               for name, dist in found.items())  # the naming rule the hint relies on (block_fusion has two names)
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = core["version"]
    assert sorted(core["optional-dependencies"]["all"]) == sorted(f"{d}=={version}" for d in distributions)
    for name, dist in found.items():
        if dist == "worldfoundry-" + name.replace("_", "-"):
            assert bundled_distribution(name) == dist, name
    for pyproject in [ROOT / "pyproject.toml", *ROOT.glob("plugins/*/pyproject.toml")]:
        project = tomllib.loads(pyproject.read_text())["project"]
        assert project.get("authors") and project.get("urls", {}).get("Homepage"), pyproject
        torch_pins = [d for d in project.get("dependencies", []) if d.startswith("torch")]
        assert all(pin == "torch>=2.11" for pin in torch_pins), (pyproject, torch_pins)  # the tested floor


def test_a_candidate_file_naming_a_missing_builtin_plugin_says_what_to_install():
    from worldfoundry.bench.candidates import validate_plugin_options
    from worldfoundry.errors import CandidateSchemaError

    with pytest.raises(CandidateSchemaError) as info:
        validate_plugin_options("candidates[0].accelerations.optimized_mha", "optimized_mha", {},
                                AccelerationRegistry(discover=False))
    message = str(info.value)
    assert message.startswith("candidates[0].accelerations.optimized_mha: unknown acceleration 'optimized_mha'")
    assert "pip install worldfoundry-optimized-mha" in message
