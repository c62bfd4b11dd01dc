"""The ``worldfoundry-svdquant-v1`` artifact: round trip (JSON + safetensors, and ``.pt``) and typed errors that
name the file and the field for every malformed input; nothing is built from a file before its header checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from worldfoundry.base_models.diffusion_model.svdquant_calibration import (
    InputAbsmaxObserver,
    build_svdquant_artifact,
    select_for_calibration,
)
from worldfoundry.core.acceleration.quantization.svdquant_artifact import (
    load_svdquant_artifact,
    save_svdquant_artifact,
)
from worldfoundry.errors import ArtifactFormatError, InvalidRequestError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def _artifact(model: nn.Module, out: Path, **kw) -> Path:
    selected = select_for_calibration(model, ["0", "2"])
    with InputAbsmaxObserver(selected) as obs:
        model(torch.randn(10, 64))
    manifest, tensors = build_svdquant_artifact(model, selected, obs.absmax, rank=8, group_size=64,
                                                include=["0", "2"], observer=obs, **kw)
    return save_svdquant_artifact(manifest, tensors, out)


@pytest.mark.parametrize("suffix", [".json", ".pt"])
def test_round_trip(tmp_path, suffix):
    model = _model()
    path = _artifact(model, tmp_path / f"a{suffix}")
    art = load_svdquant_artifact(path)
    assert art.manifest["format"] == "worldfoundry-svdquant-v1" and set(art.linears) == {"0", "2"}
    entry = art.manifest["linears"]["0"]
    assert entry["calibration"] == {"calls": 1, "rows": 10} and len(entry["source"]["weight"]["sha256"]) == 64
    w = art.weight("2")
    assert w.qweight.shape == (64, 64) and w.scales.shape == (2, 64) and w.rank == 8


def _rewrite(path: Path, edit) -> None:  # noqa: ANN001
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.update(format="nunchaku"), "format"),
    (lambda d: d.update(group_size=32), "group_size"),
    (lambda d: d.update(weight_bits=8), "weight_bits"),
    (lambda d: d["linears"]["0"].update(in_features=60), "linears['0'].in_features"),
    (lambda d: d["linears"]["0"]["source"]["weight"].update(sha256="x"), "linears['0'].source.weight.sha256"),
    (lambda d: d["tensors"].update(size_bytes=1), "size"),
    (lambda d: d["tensors"].update(file="../x.safetensors"), "tensors.file"),
    (lambda d: d["linears"]["2"].update(rank=4), "tensors['2.lora_down']"),
])
def test_malformed_manifest_names_file_and_field(tmp_path, edit, field):
    path = _artifact(_model(), tmp_path / "a.json")
    _rewrite(path, edit)
    with pytest.raises(ArtifactFormatError) as info:
        load_svdquant_artifact(path)
    assert info.value.field == field and str(tmp_path) in info.value.file


def test_tampered_tensors_and_non_finite_values(tmp_path):
    path = _artifact(_model(), tmp_path / "a.json")
    blob = path.with_suffix(".safetensors")
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0xFF
    blob.write_bytes(bytes(raw))
    with pytest.raises(ArtifactFormatError, match="sha256"):
        load_svdquant_artifact(path)
    model = _model()
    selected = select_for_calibration(model, ["0"])
    with InputAbsmaxObserver(selected) as obs:
        model(torch.randn(4, 64))
    manifest, tensors = build_svdquant_artifact(model, selected, obs.absmax, rank=8, group_size=64, observer=obs)
    tensors["0.scales"][0, 0] = float("nan")
    bad = save_svdquant_artifact(manifest, tensors, tmp_path / "nan.pt")
    with pytest.raises(ArtifactFormatError, match=r"tensors\['0.scales'\]: contains NaN"):
        load_svdquant_artifact(bad)


def test_pt_needs_weights_only_and_unknown_suffix_and_missing_file(tmp_path):
    import datetime

    evil = tmp_path / "evil.pt"
    torch.save({"manifest": {}, "tensors": {}, "x": datetime.date(2020, 1, 1)}, evil)  # not a weights-only type
    with pytest.raises(ArtifactFormatError, match="weights_only=True"):
        load_svdquant_artifact(evil)
    with pytest.raises(ArtifactFormatError, match="expected a .json manifest"):
        (tmp_path / "a.bin").write_bytes(b"0")
        load_svdquant_artifact(tmp_path / "a.bin")
    with pytest.raises(ArtifactFormatError, match="does not exist; create it with"):
        load_svdquant_artifact(tmp_path / "none.json")


def test_calibration_refuses_evaluation_seeds_and_unknown_patterns():
    from worldfoundry.base_models.diffusion_model.svdquant_calibration import calibrate_pipeline

    with pytest.raises(InvalidRequestError, match="evaluation seeds"):
        calibrate_pipeline(object(), include=["x"], seeds=[42])
    with pytest.raises(InvalidRequestError, match="--include"):
        select_for_calibration(_model(), ["blocks.*.ffn.0"])


def test_per_channel_round_trip_and_errors(tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    selected = select_for_calibration(model, ["0", "2"])
    with InputAbsmaxObserver(selected) as obs:
        model(torch.randn(6, 128))
    manifest, tensors = build_svdquant_artifact(model, selected, obs.absmax, rank=8, group_size=0, observer=obs)
    path = save_svdquant_artifact(manifest, tensors, tmp_path / "c.json")
    art = load_svdquant_artifact(path)
    assert art.group_size == 0 and art.manifest["format"] == "worldfoundry-svdquant-v1"
    w = art.weight("2")
    assert w.group_size == 0 and w.scales.shape == (1, 128) and w.qweight.shape == (128, 128)
    _rewrite(path, lambda d: d.update(group_size=True))
    with pytest.raises(ArtifactFormatError, match="expected 64, 128 or 0") as info:
        load_svdquant_artifact(path)
    assert info.value.field == "group_size"
    from worldfoundry.errors import QuantizationInputError

    small = _model()  # 64 input features: not a multiple of the per-channel K step (128)
    sel = select_for_calibration(small, ["0"])
    with InputAbsmaxObserver(sel) as obs2:
        small(torch.randn(3, 64))
    with pytest.raises(QuantizationInputError, match="per-channel K step 128"):
        build_svdquant_artifact(small, sel, obs2.absmax, rank=4, group_size=0, observer=obs2)


def test_calibrate_group_size_argument():
    import argparse

    from worldfoundry.cli.calibrate_cmd import group_size_arg

    assert [group_size_arg(v) for v in ("64", "128", "channel", "0", "Channel")] == [64, 128, 0, 0, 0]
    with pytest.raises(argparse.ArgumentTypeError, match="expected 64, 128 or channel"):
        group_size_arg("32")
