"""Mixed precision from calibration data (``svdquant_sensitivity``, ``worldfoundry calibrate svdquant
--keep-dense``): the selection keeps the unit whose quantization moves the result most dense, the manifest
records it, bad values are one-line errors, and the plugin binds the artifact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.base_models.diffusion_model.svdquant_toys import WIDTH, residual_blocks
from worldfoundry.base_models.diffusion_model.svdquant_calibration import (
    InputAbsmaxObserver,
    build_svdquant_artifact,
    select_for_calibration,
)
from worldfoundry.base_models.diffusion_model.svdquant_sensitivity import (
    RequestOutput,
    check_keep_dense,
    drop_linears,
    group_units,
    measure_sensitivity,
    quantized_linears,
    rank_units,
    sensitivity_record,
    unit_of,
    weight_from_tensors,
)
from worldfoundry.cli.main import main
from worldfoundry.core.acceleration.quantization.svdquant_artifact import (
    load_svdquant_artifact,
    save_svdquant_artifact,
)
from worldfoundry.errors import InvalidRequestError

def _toy(outlier_block: int) -> nn.Module:
    """Three residual blocks; ``outlier_block``'s weight has a huge entry per row, so 4-bit round-to-nearest
    with groups of 64 flattens the rest of its groups to zero while the other blocks quantize well."""
    model = residual_blocks(3, 0.05)
    with torch.no_grad():
        model.blocks[outlier_block].ffn.weight[:, ::64] = 3.0
    return model


def _requests(model: nn.Module) -> list[RequestOutput]:
    outs = []
    for seed in (11, 12):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            outs.append(RequestOutput(seed, model(x)))
    return outs


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for block in model.blocks:
        x = block(x)
    return x


@pytest.mark.parametrize("outlier_block", [0, 1, 2])
def test_the_selection_keeps_the_sensitive_block_dense_and_the_manifest_records_it(tmp_path: Path,
                                                                                    outlier_block: int) -> None:
    model = _toy(outlier_block)
    model.forward = lambda x: _forward(model, x)  # noqa: E731 - a callable toy
    selected = select_for_calibration(model, ["blocks.*.ffn"])
    dense = _requests(model)
    manifest, tensors = build_svdquant_artifact(model, selected, None, method="rtn", group_size=64,
                                                include=["blocks.*.ffn"], calibration={"seeds": [11, 12]})
    units = group_units([s.path for s in selected])
    assert units == {f"blocks.{b}": [f"blocks.{b}.ffn"] for b in range(3)}
    modules = {s.path: s.module for s in selected}
    weights = {p: weight_from_tensors(tensors, p, 64, "cpu") for p in modules}
    scores = measure_sensitivity(lambda: _requests(model), dense, units, modules, weights)
    ranking = rank_units(scores)
    assert ranking[0] == f"blocks.{outlier_block}"
    assert scores[ranking[0]]["latent_rel_l2"] > 2 * max(scores[u]["latent_rel_l2"] for u in ranking[1:])
    assert set(scores[ranking[0]]["per_request"]) == {"11", "12"}
    record = sensitivity_record(scores, keep_dense=1, unit="block", metric="latent_rel_l2", backend="reference",
                                seeds=[11, 12])
    drop_linears(manifest, tensors, record["kept_dense_linears"])
    manifest["calibration"]["sensitivity"] = record
    art = load_svdquant_artifact(save_svdquant_artifact(manifest, tensors, tmp_path / "a.json"))
    assert sorted(art.linears) == sorted(p for p in modules if p != f"blocks.{outlier_block}.ffn")
    saved = json.loads((tmp_path / "a.json").read_text())["calibration"]["sensitivity"]
    assert saved["kept_dense"] == [f"blocks.{outlier_block}"] and saved["ranking"] == ranking


def test_quantized_linears_runs_the_quantized_numerics_and_restores_the_forward() -> None:
    model = _toy(1)
    model.forward = lambda x: _forward(model, x)  # noqa: E731
    selected = select_for_calibration(model, ["blocks.1.ffn"])
    with InputAbsmaxObserver(selected) as obs:
        _requests(model)
    _, tensors = build_svdquant_artifact(model, selected, obs.absmax, rank=8, group_size=64, observer=obs)
    dense = _requests(model)[0].latents
    linear = model.blocks[1].ffn
    weight = weight_from_tensors(tensors, "blocks.1.ffn", 64, "cpu")
    with quantized_linears({"blocks.1.ffn": linear}, {"blocks.1.ffn": weight}):
        changed = _requests(model)[0].latents
    assert not torch.equal(changed, dense) and torch.equal(_requests(model)[0].latents, dense)
    assert "forward" not in vars(linear)


def test_units_and_bad_values() -> None:
    assert unit_of("blocks.3.ffn.net.2") == "blocks.3" and unit_of("proj_out") == "proj_out"
    assert unit_of("blocks.3.ffn.net.2", "linear") == "blocks.3.ffn.net.2"
    assert check_keep_dense(0, 6) == 0 and check_keep_dense(5, 6) == 5
    for value, units, message in ((-1, None, "non-negative"), (True, None, "non-negative"),
                                  (6, 6, "would keep every unit dense"), (1, 1, "give at most 0")):
        with pytest.raises(InvalidRequestError, match=message):
            check_keep_dense(value, units)
    with pytest.raises(InvalidRequestError, match="--sensitivity-unit"):
        unit_of("blocks.0.ffn", "layer")
    with pytest.raises(InvalidRequestError, match="--sensitivity-metric"):
        rank_units({"a": {"latent_rel_l2": 0.1}}, "ssim")
    with pytest.raises(InvalidRequestError, match="no such score"):
        rank_units({"a": {"latent_rel_l2": 0.1}}, "min_ssim")
    assert rank_units({"a": {"min_ssim": 0.9}, "b": {"min_ssim": 0.8}}, "min_ssim") == ["b", "a"]


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "no-such-recipe", "--keep-dense", "-1"], "--keep-dense must be a non-negative integer, got -1"),
    (["--recipe", "no-such-recipe", "--keep-dense", "1", "--dense-from", "x.json"], "not both"),
    (["--recipe", "tiny-wan2.1", "--random-weights", "--frames", "5", "--steps", "1", "--keep-dense", "2"],
     "--keep-dense 2 would keep every unit dense: the selection has 2 unit(s); give at most 1"),
])
def test_bad_keep_dense_is_one_line(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    rc = main(["calibrate", "svdquant", *argv, "--out", str(tmp_path / "a.json")])
    err = capsys.readouterr().err
    assert rc == 1 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "a.json").exists()


def test_keep_dense_artifact_binds_and_rtn_reuses_its_selection(tmp_path: Path, capsys) -> None:
    from worldfoundry_svdquant.plugin import _artifact_summary, prepare

    from worldfoundry.base_models.diffusion_model.pipeline import NativeDiffusionPipeline
    from worldfoundry.core.model_loading.policy import RuntimePolicy

    small = ["--recipe", "tiny-wan2.1", "--random-weights", "--frames", "5", "--steps", "2"]
    out, rtn = tmp_path / "k.json", tmp_path / "rtn.json"
    assert main(["calibrate", "--json", "svdquant", *small, "--rank", "8", "--keep-dense", "1",
                 "--sensitivity-unit", "linear", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    record = load_svdquant_artifact(out).manifest["calibration"]["sensitivity"]
    assert record["unit"] == "linear" and record["seeds"] == [11, 12] and len(record["scores"]) == 4
    assert summary["kept_dense"] == record["kept_dense_linears"] == record["ranking"][:1]
    assert summary["linears"] == 3 and record["kept_dense"][0] not in summary["weight_rel_l2"]
    assert main(["calibrate", "svdquant", *small, "--method", "rtn", "--dense-from", str(out),
                 "--out", str(rtn)]) == 0
    quantized = sorted(load_svdquant_artifact(out).linears)
    assert sorted(load_svdquant_artifact(rtn).linears) == quantized
    assert load_svdquant_artifact(rtn).manifest["calibration"]["sensitivity"]["from_artifact"] == str(out)
    assert main(["calibrate", "svdquant", *small, "--dense-from", str(rtn), "--include", "blocks.0.ffn.0",
                 "--out", str(tmp_path / "x.json")]) == 1
    policy = RuntimePolicy(device="cpu", dtype=torch.float32)
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=policy, random_weights=True) as pipe:
        plan = prepare(pipe.components.denoiser.model, {"artifact": str(out)}, policy)
    assert sorted(c for c in plan.claims if not c.startswith("role:")) == quantized
    assert _artifact_summary(load_svdquant_artifact(out))["kept_dense"] == record["kept_dense_linears"]


def test_calibrate_plugins_script_shares_the_option(tmp_path: Path, capsys) -> None:
    import importlib.util
    import sys

    from worldfoundry.core.model_loading.recipes import project_root

    bench = project_root() / "benchmarks" / "inference"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("calibrate_plugins_keep_dense_test",
                                                      bench / "calibrate_plugins.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        rc = module.cli(["svdquant", "--recipe", "no-such-recipe", "--keep-dense", "-1", "--out",
                         str(tmp_path / "a.pt")])
    finally:
        sys.path.remove(str(bench))
        sys.modules.pop("calibrate_plugins_keep_dense_test", None)
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == "calibrate_plugins.py: error: --keep-dense must be a non-negative integer, got -1"
