"""Sequential calibration (``svdquant_sequential``, ``worldfoundry calibrate svdquant --sequential``): each block's
Linears are observed with the blocks before it quantized; the first keeps the dense statistics; the model is
restored; the artifact records it; and RTN refuses it in one line."""

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
    linear_decomposer,
    select_for_calibration,
)
from worldfoundry.base_models.diffusion_model.svdquant_sensitivity import quantized_linears
from worldfoundry.base_models.diffusion_model.svdquant_sequential import sequential_statistics
from worldfoundry.cli.main import main
from worldfoundry.core.acceleration.quantization.svdquant_artifact import load_svdquant_artifact


def _toy() -> nn.Module:
    return residual_blocks(3, 0.2, torch.tanh)  # a quantized block changes the inputs of the blocks after it


def _run(model: nn.Module) -> list[torch.Tensor]:
    outs = []
    for seed in (11, 12):
        x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-1, 1, WIDTH)
        with torch.no_grad():
            outs.append(model(x))
    return outs


SETTINGS = {"rank": 8, "group_size": 64, "rounding": "gptq"}


def test_each_block_is_observed_with_the_blocks_before_it_quantized() -> None:
    model = _toy()
    selected = select_for_calibration(model, ["blocks.*.ffn"])
    before = _run(model)
    with InputAbsmaxObserver(selected, second_moments=True) as dense:
        _run(model)
    observer, decomposed, units = sequential_statistics(
        selected, dense, lambda: _run(model), InputAbsmaxObserver,
        lambda obs: linear_decomposer(model, selected, obs.absmax, obs, **SETTINGS))
    assert units == ["blocks.0", "blocks.1", "blocks.2"] and sorted(decomposed) == [s.path for s in selected]
    assert torch.equal(observer.absmax["blocks.0.ffn"], dense.absmax["blocks.0.ffn"])  # the first unit: dense
    assert torch.equal(observer.moments["blocks.0.ffn"], dense.moments["blocks.0.ffn"])
    for k in (1, 2):  # a later unit: what it sees behind the quantized blocks before it, observed by hand
        path = f"blocks.{k}.ffn"
        earlier = {f"blocks.{j}.ffn": model.blocks[j].ffn for j in range(k)}
        with quantized_linears(earlier, {p: decomposed[p] for p in earlier}), \
                InputAbsmaxObserver([s for s in selected if s.path == path], second_moments=True) as manual:
            _run(model)
        assert torch.equal(observer.absmax[path], manual.absmax[path])
        assert torch.equal(observer.moments[path], manual.moments[path])
        assert not torch.equal(observer.moments[path], dense.moments[path])
        assert observer.calls[path] == dense.calls[path] == 2
    assert all(torch.equal(a, b) for a, b in zip(_run(model), before))  # the forwards are back
    assert all("forward" not in vars(s.module) for s in selected)
    one = linear_decomposer(model, selected, observer.absmax, observer, **SETTINGS)
    again = one(selected[2])
    assert torch.equal(again.qweight, decomposed["blocks.2.ffn"].qweight)  # decomposed from those statistics


def test_the_artifact_takes_the_sequential_decompositions_as_they_are() -> None:
    model = _toy()
    selected = select_for_calibration(model, ["blocks.*.ffn"])
    with InputAbsmaxObserver(selected, second_moments=True) as dense:
        _run(model)
    observer, decomposed, _ = sequential_statistics(
        selected, dense, lambda: _run(model), InputAbsmaxObserver,
        lambda obs: linear_decomposer(model, selected, obs.absmax, obs, **SETTINGS))
    manifest, tensors = build_svdquant_artifact(model, selected, observer.absmax, observer=observer,
                                                decomposed=decomposed, **SETTINGS)
    for path, q in decomposed.items():
        assert torch.equal(tensors[f"{path}.qweight"], q.qweight) and torch.equal(tensors[f"{path}.scales"], q.scales)
        assert manifest["linears"][path]["calibration"] == {"calls": 2, "rows": 32}
    plain, plain_tensors = build_svdquant_artifact(model, selected, dense.absmax, observer=dense, **SETTINGS)
    assert torch.equal(plain_tensors["blocks.0.ffn.qweight"], tensors["blocks.0.ffn.qweight"])
    assert not torch.equal(plain_tensors["blocks.2.ffn.qweight"], tensors["blocks.2.ffn.qweight"])


SMALL = ["--recipe", "tiny-wan2.1", "--random-weights", "--frames", "5", "--steps", "2", "--rank", "8"]


def test_the_command_records_the_sequential_calibration_and_the_plugin_binds_it(tmp_path: Path, capsys) -> None:
    from worldfoundry_svdquant.plugin import prepare

    from worldfoundry.base_models.diffusion_model.pipeline import NativeDiffusionPipeline
    from worldfoundry.core.model_loading.policy import RuntimePolicy

    out = tmp_path / "seq.json"
    assert main(["calibrate", "--json", "svdquant", *SMALL, "--rounding", "gptq", "--keep-dense", "1",
                 "--sequential", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    calibration = load_svdquant_artifact(out).manifest["calibration"]
    kept = calibration["sensitivity"]["kept_dense"]
    assert summary["sequential"] is True and len(kept) == 1
    assert calibration["sequential"]["unit"] == "block" and kept[0] not in calibration["sequential"]["units"]
    assert calibration["sequential"]["reruns"] == len(calibration["sequential"]["units"]) - 1 == 0
    policy = RuntimePolicy(device="cpu", dtype=torch.float32)
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=policy, random_weights=True) as pipe:
        plan = prepare(pipe.components.denoiser.model, {"artifact": str(out)}, policy)
    assert sorted(c for c in plan.claims if not c.startswith("role:")) == sorted(load_svdquant_artifact(out).linears)


def test_two_blocks_give_one_rerun(tmp_path: Path, capsys) -> None:
    out = tmp_path / "seq.json"
    assert main(["calibrate", "svdquant", *SMALL, "--sequential", "--out", str(out)]) == 0
    sequential = load_svdquant_artifact(out).manifest["calibration"]["sequential"]
    assert sequential == {"unit": "block", "units": ["blocks.0", "blocks.1"], "reruns": 1}


@pytest.mark.parametrize("argv", [["--method", "rtn", "--sequential"]])
def test_sequential_rtn_is_one_line(tmp_path: Path, capsys, argv: list[str]) -> None:
    rc = main(["calibrate", "svdquant", *SMALL, *argv, "--out", str(tmp_path / "a.json")])
    err = capsys.readouterr().err
    assert rc == 1 and "--sequential refits statistics for --method svdquant; RTN uses none" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "a.json").exists()
