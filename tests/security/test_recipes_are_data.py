"""Recipes are data: class references resolve only through the allowlist, the working directory is never searched.

The exploit reproduced here once ran code: ``worldfoundry bench --candidates c.json`` with ``"model": "evil.yaml"``
(or ``"model": "innocent-tiny"`` with ``./recipes/innocent-tiny.yaml`` present) imported ``builtins.exec`` and called
it with a program taken from the recipe. Each test proves no code ran: the marker file the program would write is
absent.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from worldfoundry.base_models.diffusion_model.pipeline import NativeDiffusionPipeline
from worldfoundry.cli.main import main
from worldfoundry.core.model_loading.class_allowlist import CLASS_ENTRY_POINT_GROUP, resolve_class
from worldfoundry.core.model_loading.recipes import available_recipes, load_recipe, parse_recipe, recipe_dirs
from worldfoundry.core.model_loading.weights import build_random
from worldfoundry.errors import ClassNotAllowedError, RecipeError, UnknownRecipeError


def test_exploit_recipe_named_by_candidate_file_runs_no_code(tmp_path, marker, exploit_recipe, candidate_document,
                                                            write_json, capsys) -> None:
    exploit_recipe(tmp_path, "evil", marker)
    cands = write_json(tmp_path / "c.json", candidate_document(model="evil.yaml"))
    out = tmp_path / "out"
    rc = main(["bench", "--candidates", str(cands), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert not marker.exists(), "the recipe's code ran"
    assert not out.exists(), "--out was created before the recipe was validated"
    assert f"loading recipe file {(tmp_path / 'evil.yaml').resolve()}" in err  # announced before it is read
    assert "'builtins.exec' is not an allowed class" in err and "Traceback" not in err


def test_recipe_in_working_directory_is_not_found_by_name(tmp_path, marker, exploit_recipe, candidate_document,
                                                          write_json, monkeypatch, capsys) -> None:
    exploit_recipe(tmp_path / "recipes", "innocent-tiny", marker)
    monkeypatch.chdir(tmp_path)
    assert "innocent-tiny" not in available_recipes()
    assert all(d.resolve() != (tmp_path / "recipes").resolve() for d in recipe_dirs())
    with pytest.raises(UnknownRecipeError, match="not used by name"):
        load_recipe("innocent-tiny")
    cands = write_json(tmp_path / "c.json", candidate_document(model="innocent-tiny"))
    rc = main(["bench", "--candidates", str(cands), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown recipe 'innocent-tiny'" in err and "--recipe-file" in err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_explicit_recipe_file_is_announced_and_still_cannot_run_code(tmp_path, marker, exploit_recipe,
                                                                     candidate_document, write_json, monkeypatch,
                                                                     capsys) -> None:
    exploit_recipe(tmp_path / "recipes", "innocent-tiny", marker)
    monkeypatch.chdir(tmp_path)
    doc = candidate_document()
    del doc["model"]
    cands = write_json(tmp_path / "c.json", doc)
    rc = main(["bench", "--candidates", str(cands), "--recipe-file", "recipes/innocent-tiny.yaml",
               "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "loading recipe file" in err and "(from --recipe-file)" in err
    assert "not an allowed class" in err and not marker.exists() and not (tmp_path / "out").exists()


def test_exploit_through_the_python_api_runs_no_code(tmp_path, marker, exploit_recipe) -> None:
    path = exploit_recipe(tmp_path, "evil", marker)
    with pytest.raises(ClassNotAllowedError, match="builtins.exec"):
        NativeDiffusionPipeline.from_pretrained(path)
    recipe = load_recipe(path)
    with pytest.raises(ClassNotAllowedError):
        build_random(recipe.denoiser, recipe, seed=0, device=torch.device("cpu"), dtype=None)
    assert not marker.exists()


@pytest.mark.parametrize("reference", [
    "builtins.exec", "builtins.eval", "os.system", "subprocess.Popen", "pickle.loads", "torch.load",
    "diffusers.utils.load_image", "diffusers.DiffusionPipeline", "diffusers.__class__", "diffusers.__builtins__",
    "transformers.pipeline", "transformers.AutoTokenizer", "diffusers.models.WanTransformer3DModel",
    "worldfoundry.core.model_loading.weights.build_random", "builtins.object",
])
def test_references_outside_the_allowlist_are_refused(reference: str) -> None:
    with pytest.raises(ClassNotAllowedError, match="not an allowed class|has no class"):
        resolve_class(reference, recipe="r", component="denoiser")


@pytest.mark.parametrize("reference", [None, "", "exec", 3])
def test_malformed_references_are_recipe_errors(reference) -> None:
    with pytest.raises(RecipeError, match="dotted class name"):
        resolve_class(reference, recipe="r", component="denoiser")


def test_every_shipped_recipe_class_is_on_the_allowlist() -> None:
    checked = 0
    for name in available_recipes():
        recipe = load_recipe(name)
        for component in recipe.components.values():
            for field, ref in (("class", component.class_path), ("config_class", component.config_class)):
                if ref:
                    assert isinstance(resolve_class(ref, recipe=name, component=component.name, field=field), type)
                    checked += 1
    assert checked > 20


def test_third_party_classes_come_only_from_installed_entry_points(tmp_path, monkeypatch) -> None:
    (tmp_path / "thirdparty_codec.py").write_text(textwrap.dedent("""\
        import torch.nn as nn
        class TinyCodec(nn.Module):
            @classmethod
            def from_config(cls, config):
                return cls()
        """))
    dist = tmp_path / "thirdparty_codec-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-codec\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{CLASS_ENTRY_POINT_GROUP}]\nthirdparty.TinyCodec = thirdparty_codec:TinyCodec\n")
    with pytest.raises(ClassNotAllowedError):
        resolve_class("thirdparty.TinyCodec", recipe="r", component="codec")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("WORLDFOUNDRY_PLUGINS", raising=False)
    assert resolve_class("thirdparty.TinyCodec", recipe="r", component="codec").__name__ == "TinyCodec"
    monkeypatch.setenv("WORLDFOUNDRY_PLUGINS", "")  # the plugin allowlist applies to class entry points too
    with pytest.raises(ClassNotAllowedError):
        resolve_class("thirdparty.TinyCodec", recipe="r", component="codec")
    sys.modules.pop("thirdparty_codec", None)


def test_recipe_resolvers_are_refused(tmp_path) -> None:
    text = load_recipe("tiny-wan2.1").path.read_text().replace("description: ", "description: ${oc.env:HOME} ", 1)
    path = tmp_path / "env.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match="OmegaConf resolver"):
        load_recipe(path)


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b"a: [unclosed", b"- a list\n"])
def test_malformed_recipe_files_are_recipe_errors(tmp_path, content: bytes) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(RecipeError):
        load_recipe(path)


def test_recipe_path_that_is_a_directory_or_device_is_refused(tmp_path) -> None:
    from worldfoundry.errors import InputFileError

    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(InputFileError, match="is a directory"):
        load_recipe(tmp_path / "d.yaml")
    if Path("/dev/zero").exists():
        (tmp_path / "zero.yaml").symlink_to("/dev/zero")
        with pytest.raises(InputFileError, match="character device"):
            load_recipe(tmp_path / "zero.yaml")


def test_parse_recipe_keeps_class_strings_as_data() -> None:
    recipe = parse_recipe({"name": "x", "family": "wan", "components": {"denoiser": {"class": "os.system"}}})
    assert recipe.denoiser.class_path == "os.system"  # parsing never imports; resolving refuses
    with pytest.raises(ClassNotAllowedError):
        resolve_class(recipe.denoiser.class_path, recipe="x", component="denoiser")
