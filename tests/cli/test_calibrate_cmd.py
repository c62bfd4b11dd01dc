"""``worldfoundry calibrate svdquant`` writes a bound artifact the plugin accepts, with provenance and references;
the shipped tiny-model artifacts bind to the shipped trained weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from worldfoundry.cli.main import main
from worldfoundry.core.acceleration.quantization.svdquant_artifact import load_svdquant_artifact
from worldfoundry.core.model_loading.recipes import project_root

#: shipped artifact -> the Linears it quantizes (the keep2 pair leaves blocks 0 and 1 dense)
SHIPPED = {"svdquant-r32-g64.json": 12, "rtn-g64.json": 12, "svdquant-r64-ch-keep2.json": 8, "rtn-ch-keep2.json": 8}


def test_calibrate_svdquant_on_the_tiny_recipe(tmp_path: Path, capsys) -> None:
    out = tmp_path / "a.json"
    rc = main(["calibrate", "--json", "svdquant", "--recipe", "tiny-wan2.1", "--random-weights", "--frames", "5",
               "--steps", "2", "--rank", "8", "--out", str(out), "--save-references", str(tmp_path / "refs")])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["artifact"] == str(out) and summary["linears"] == 4 and summary["rank"] == 8
    art = load_svdquant_artifact(out)
    cal = art.manifest["calibration"]
    assert cal["seeds"] == [11, 12] and cal["frames"] == 5 and cal["random_weights"] is True
    assert sorted(art.linears) == ["blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2", "blocks.1.ffn.net.0.proj",
                                   "blocks.1.ffn.net.2"]
    assert art.manifest["include"] == ["blocks.*.ffn.0", "blocks.*.ffn.2"]
    ref = torch.load(tmp_path / "refs" / "calibration_11.pt", weights_only=True)
    assert ref["seed"] == 11 and ref["video"].shape[0] == 5


def test_calibrate_refuses_evaluation_seeds(tmp_path: Path, capsys) -> None:
    rc = main(["calibrate", "svdquant", "--recipe", "tiny-wan2.1", "--random-weights", "--seeds", "42",
               "--out", str(tmp_path / "a.json")])
    assert rc == 1 and "evaluation seeds" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_artifacts_bind_to_the_trained_tiny_model(name: str) -> None:
    from worldfoundry_svdquant.plugin import prepare

    from worldfoundry.base_models.diffusion_model.pipeline import NativeDiffusionPipeline
    from worldfoundry.core.model_loading.policy import RuntimePolicy

    path = project_root() / "recipes" / "assets" / "tiny-wan2.1-trained" / "svdquant" / name
    policy = RuntimePolicy(device="cpu", dtype=torch.float32)
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1-trained", policy=policy) as pipe:
        plan = prepare(pipe.components.denoiser.model, {"artifact": str(path)}, policy)
    assert len([c for c in plan.claims if not c.startswith("role:")]) == SHIPPED[name]


def test_calibrate_plugins_script_svdquant_writes_pt_and_summary(tmp_path: Path) -> None:
    import importlib.util
    import sys

    bench = project_root() / "benchmarks" / "inference"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("calibrate_plugins_svdquant_test", bench / "calibrate_plugins.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
        sys.modules.pop("calibrate_plugins_svdquant_test", None)
    out = tmp_path / "svdquant.pt"
    summary = module.main(["svdquant", "--recipe", "tiny-wan2.1", "--random-weights", "--include", "blocks.*.ffn.0",
                           "blocks.*.ffn.2", "--rank", "8", "--frames", "5", "--steps", "1", "--out", str(out)])
    assert summary["artifact"] == str(out) and (tmp_path / "svdquant.json").is_file()
    assert load_svdquant_artifact(out).manifest["rank"] == 8


def test_calibrate_unsmoothed_linears(tmp_path: Path, capsys) -> None:
    out = tmp_path / "u.json"
    rc = main(["calibrate", "--json", "svdquant", "--recipe", "tiny-wan2.1", "--random-weights", "--frames", "5",
               "--steps", "2", "--rank", "8", "--unsmoothed", "blocks.*.ffn.2", "--out", str(out)])
    assert rc == 0
    art = load_svdquant_artifact(out)
    assert art.manifest["unsmoothed"] == ["blocks.*.ffn.2"]
    for path, record in art.manifest["linears"].items():
        assert record["smoothed"] is (not path.endswith("ffn.net.2"))
        assert (f"{path}.inv_smooth" in art.tensors) is (not path.endswith("ffn.net.2"))
    capsys.readouterr()
    rc = main(["calibrate", "svdquant", "--recipe", "tiny-wan2.1", "--random-weights", "--frames", "5", "--steps",
               "2", "--include", "blocks.*.ffn.0", "--unsmoothed", "blocks.*.ffn.2", "--out", str(tmp_path / "v.json")])
    err = capsys.readouterr().err
    assert rc == 1 and "--unsmoothed 'blocks.*.ffn.2' selects none of the calibrated Linears" in err
    assert not (tmp_path / "v.json").exists()


def test_calibrate_with_a_refined_whitened_fit_records_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "w.json"
    rc = main(["calibrate", "--json", "svdquant", "--recipe", "tiny-wan2.1", "--random-weights", "--frames", "5",
               "--steps", "2", "--rank", "8", "--lowrank-fit", "whitened", "--refine", "2", "--out", str(out)])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["lowrank_fit"] == "whitened" and summary["refine"] == 2
    cal = load_svdquant_artifact(out).manifest["calibration"]
    assert (cal["lowrank_fit"], cal["refine"], cal["rounding"]) == ("whitened", 2, "nearest")


def test_calibrate_refuses_a_bad_refine_before_running_requests(tmp_path: Path, capsys) -> None:
    rc = main(["calibrate", "svdquant", "--recipe", "no-such-recipe", "--refine", "17", "--out",
               str(tmp_path / "a.json")])
    err = capsys.readouterr().err
    assert rc == 1 and "--refine must be an integer in [0, 16], got 17" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "a.json").exists()


def test_calibrate_with_ordered_gptq_rounding_records_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "o.json"
    rc = main(["calibrate", "--json", "svdquant", "--recipe", "tiny-wan2.1", "--random-weights", "--frames", "5",
               "--steps", "2", "--rank", "8", "--rounding", "gptq-ordered", "--out",
               str(out)])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["rounding"] == "gptq-ordered"
    assert load_svdquant_artifact(out).manifest["calibration"]["rounding"] == "gptq-ordered"


def test_the_rounding_choices_are_the_numerics_ones() -> None:
    import argparse  # noqa: PLC0415

    from worldfoundry.cli.calibrate_cmd import add_svdquant_arguments  # noqa: PLC0415
    from worldfoundry.core.acceleration.quantization.svdquant_numerics import ROUNDINGS  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    add_svdquant_arguments(parser)
    rounding = next(a for a in parser._actions if a.dest == "rounding")  # noqa: SLF001
    assert tuple(rounding.choices) == ROUNDINGS
