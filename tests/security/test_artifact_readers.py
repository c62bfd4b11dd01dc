"""Artifact readers — attention LoRA adapters, LightVAE FP8 calibration artifacts, codec checkpoints, residency
configs, calibration clips — check structure, types, finiteness and size bounds and raise a typed error naming the
file and the field. Nothing read from them is called: pickled code in a ``.pt`` file is refused unrun."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worldfoundry.base_models.diffusion_model.codec import (
    install_fp8_encoder,
    load_wan_video_codec,
    random_wan_video_codec,
)
from worldfoundry.base_models.diffusion_model.codec_checkpoints import to_original_state_dict
from worldfoundry.base_models.diffusion_model.codec_fp8 import (
    calibrate_encoder_fp8,
    load_artifact,
    load_clip,
    save_artifact,
    validate_artifact,
)
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.errors import (
    AccelerationOptionsError,
    ArtifactMismatchError,
    CalibrationArtifactError,
    CheckpointError,
    InvalidRequestError,
    NonFiniteWeightsError,
    WorldFoundryError,
)

ROOT = Path(__file__).resolve().parents[2]
HAS_DEV_ZERO = Path("/dev/zero").exists()


class _RunsCode:
    """A pickle whose loading would call ``open(marker, "w")``: a poisoned ``.pt`` file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _poison(path: Path, marker: Path) -> Path:
    with open(path, "wb") as handle:
        pickle.dump({"encoder.conv1.weight": _RunsCode(marker)}, handle)
    return path


# --------------------------------------------------------------------------------------- LightVAE FP8 artifact


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("student")
    ckpt = root / "student.pth"
    torch.save(to_original_state_dict(random_wan_video_codec("lightvae-wan21", seed=5).module.state_dict()), ckpt)
    codec = load_wan_video_codec(ckpt, "lightvae-wan21", device="cpu")
    clip = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(11)) * 2 - 1
    artifact = calibrate_encoder_fp8(codec, [("synthetic:11", clip)], include=["encoder.down_blocks.0.*"], frames=5)
    return {"root": root, "ckpt": ckpt, "codec": codec, "artifact": artifact}


def _set(doc: dict, dotted: str, value) -> dict:
    """A deep copy of ``doc`` with the field at ``dotted`` (``checkpoint.sha256``) replaced by ``value``."""
    doc = copy.deepcopy(doc)
    *parents, last = dotted.split(".")
    node = doc
    for key in parents:
        node = node[key]
    node[last] = value
    return doc


def _first_conv(artifact: dict) -> str:
    return next(iter(artifact["convolutions"]))


MALFORMED = [
    ("checkpoint", "x", "checkpoint"),
    ("checkpoint.sha256", "z" * 64, "checkpoint.sha256"),
    ("checkpoint.size_bytes", -3, "checkpoint.size_bytes"),
    ("encoder_parameters_sha256", 7, "encoder_parameters_sha256"),
    ("tensor_structure", "all", "tensor_structure"),
    ("calibration", [], "calibration"),
    ("calibration.frames", 0, "calibration.frames"),
    ("convolutions", {}, "convolutions"),
    ("variant", None, "variant"),
    ("fp8_dtype", "float8_e5m2", "fp8_dtype"),
]


@pytest.mark.parametrize(("field", "value", "key"), MALFORMED)
def test_each_malformed_artifact_field_names_file_and_key(student, tmp_path, field, value, key) -> None:
    path = save_artifact(_set(student["artifact"], field, value), tmp_path / "bad.pt")
    with pytest.raises(CalibrationArtifactError) as info:
        load_artifact(path)
    assert info.value.key == key and info.value.file == str(path), str(info.value)


@pytest.mark.parametrize(("entry_key", "value"), [("amax", torch.tensor(float("nan"))), ("amax", -1.0),
                                                 ("amax", "big"), ("amax", torch.ones(3)), ("calls", -1),
                                                 ("geometry", "3x3")])
def test_malformed_convolution_entries(student, tmp_path, entry_key, value) -> None:
    doc = copy.deepcopy(student["artifact"])
    conv = _first_conv(doc)
    doc["convolutions"][conv][entry_key] = value
    with pytest.raises(CalibrationArtifactError) as info:
        load_artifact(save_artifact(doc, tmp_path / "bad.pt"))
    assert info.value.key == f"convolutions[{conv!r}].{entry_key}"


def test_unknown_fields_and_malformed_geometry_values(student, tmp_path) -> None:
    doc = copy.deepcopy(student["artifact"])
    doc["run_this"] = "print(1)"
    with pytest.raises(CalibrationArtifactError, match=r"unknown field\(s\) \['run_this'\]"):
        load_artifact(save_artifact(doc, tmp_path / "a.pt"))
    doc = copy.deepcopy(student["artifact"])
    doc["convolutions"][_first_conv(doc)]["geometry"]["stride"] = "wide"
    with pytest.raises(CalibrationArtifactError, match="geometry"):
        validate_artifact(doc, student["codec"].module.encoder)


def test_checkpoint_sha256_must_be_hex(student) -> None:
    encoder = student["codec"].module.encoder
    with pytest.raises(CalibrationArtifactError, match="checkpoint_sha256.*64 lowercase"):
        validate_artifact(student["artifact"], encoder, checkpoint_sha256="z" * 64)
    assert validate_artifact(student["artifact"], encoder, checkpoint_sha256=student["artifact"]["checkpoint"]["sha256"])


@pytest.mark.parametrize(("field", "value", "key"), MALFORMED)
def test_malformed_artifact_through_the_plugin_is_typed_not_prepare_failed(student, tmp_path, field, value,
                                                                           key) -> None:
    from worldfoundry_lightvae.plugin import prepare

    registry = AccelerationRegistry(discover=False)
    registry.register("lightvae", prepare)
    path = save_artifact(_set(student["artifact"], field, value), tmp_path / "bad.pt")
    codec = student["codec"]
    before = {k: v.clone() for k, v in codec.module.encoder.state_dict().items()}
    with pytest.raises(CalibrationArtifactError) as info:
        install_fp8_encoder(codec, path, backend="reference", registry=registry)
    assert info.value.key == key and str(path) in str(info.value) and "prepare failed" not in str(info.value)
    assert codec.fp8_session is None and all(torch.equal(before[k], v) for k, v in codec.module.encoder.state_dict().items())


@pytest.mark.skipif(not HAS_DEV_ZERO, reason="no /dev/zero")
def test_artifact_and_clip_special_files_are_refused(tmp_path) -> None:
    (tmp_path / "zero.pt").symlink_to("/dev/zero")
    with pytest.raises(ArtifactMismatchError, match="character device"):
        load_artifact(tmp_path / "zero.pt")
    with pytest.raises(InvalidRequestError, match="character device"):
        load_clip(tmp_path / "zero.pt", 5)


def test_poisoned_and_nan_clips_are_refused(tmp_path) -> None:
    marker = tmp_path / "MARKER"
    with pytest.raises(InvalidRequestError, match="cannot read calibration clip"):
        load_clip(_poison(tmp_path / "clip.pt", marker), 5)
    assert not marker.exists()
    clip = torch.zeros(1, 3, 5, 16, 16)
    clip[0, 0, 0, 0, 0] = float("nan")
    torch.save(clip, tmp_path / "nan.pt")
    with pytest.raises(InvalidRequestError, match="NaN or Inf"):
        load_clip(tmp_path / "nan.pt", 5)


# --------------------------------------------------------------------------------------- codec checkpoints


def test_nan_weight_in_a_codec_file_is_refused(tmp_path) -> None:
    state = to_original_state_dict(random_wan_video_codec("lightvae-wan21", seed=1).module.state_dict())
    state["decoder.head.2.bias"] = state["decoder.head.2.bias"].clone()
    state["decoder.head.2.bias"][0] = float("nan")
    torch.save(state, tmp_path / "nan.pth")
    with pytest.raises(NonFiniteWeightsError) as info:
        load_wan_video_codec(tmp_path / "nan.pth", "lightvae-wan21", device="cpu")
    assert info.value.key == "decoder.head.2.bias"


def test_poisoned_codec_file_runs_no_code(tmp_path) -> None:
    marker = tmp_path / "MARKER"
    with pytest.raises(CheckpointError, match="weights_only"):
        load_wan_video_codec(_poison(tmp_path / "evil.pth", marker), "lightvae-wan21", device="cpu")
    assert not marker.exists()


@pytest.mark.skipif(not HAS_DEV_ZERO, reason="no /dev/zero")
def test_codec_file_that_is_a_device_is_refused(tmp_path) -> None:
    (tmp_path / "zero.pth").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="character device"):
        load_wan_video_codec(tmp_path / "zero.pth", "lightvae-wan21", device="cpu")


def test_calibrate_plugins_on_a_poisoned_file_prints_no_traceback(tmp_path) -> None:
    marker = tmp_path / "MARKER"
    ckpt = _poison(tmp_path / "evil.pth", marker)
    script = ROOT / "benchmarks" / "inference" / "calibrate_plugins.py"
    proc = subprocess.run([sys.executable, str(script), "lightvae_fp8", "--checkpoint", str(ckpt), "--device", "cpu",
                           "--frames", "5", "--height", "32", "--width", "32", "--out", str(tmp_path / "a.pt")],
                          capture_output=True, text=True, env={**os.environ}, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "error:" in proc.stderr and "weights_only" in proc.stderr
    assert not marker.exists() and not (tmp_path / "a.pt").exists()


# --------------------------------------------------------------------------------------- attention LoRA


def test_attention_lora_path_none_says_what_to_do() -> None:
    from worldfoundry_attention_lora.source import load_adapter_file

    for path in (None, ""):
        with pytest.raises(AccelerationOptionsError, match="no adapter file given") as info:
            load_adapter_file(path)
        assert "''" not in str(info.value)


@pytest.mark.skipif(not HAS_DEV_ZERO, reason="no /dev/zero")
def test_attention_lora_adapter_special_file_is_not_read(tmp_path) -> None:
    from worldfoundry_attention_lora.source import load_adapter_file

    (tmp_path / "zero.safetensors").symlink_to("/dev/zero")
    with pytest.raises(AccelerationOptionsError, match="character device"):
        load_adapter_file(tmp_path / "zero.safetensors")
    with pytest.raises(AccelerationOptionsError, match="is a directory"):
        load_adapter_file(tmp_path)


def test_in_memory_lora_with_a_meta_tensor_is_refused() -> None:
    from worldfoundry_attention_lora.source import state_dict_source

    state = {"blocks.0.attn1.to_q.lora_A.weight": torch.empty(4, 64, device="meta"),
             "blocks.0.attn1.to_q.lora_B.weight": torch.zeros(64, 4)}
    with pytest.raises(ArtifactMismatchError, match="meta tensor"):
        state_dict_source(state)
    with pytest.raises(ArtifactMismatchError, match="strided"):
        state_dict_source({"k": torch.zeros(2, 2).to_sparse()})


# --------------------------------------------------------------------------------------- residency configs


@pytest.mark.parametrize(("content", "text", "path"), [
    ('{"offload_resident_blocks": 2, "offload_resident_blocks": 3}', "duplicate key", "config"),
    ('{"offload_resident_blocks": -1}', "expected an integer", "config.offload_resident_blocks"),
    ('{"offload_resident_blocks": 2, "resident_block_indices": [0, "1"]}', "block indices",
     "config.resident_block_indices"),
    ('{"offload_resident_blocks": 2, "num_blocks": 1e400}', "out of range", "config"),
    ('{"offload_resident_blocks": 2, "cpu_offload_block_contiguous": "yes"}', "true or false",
     "config.cpu_offload_block_contiguous"),
    ('{"offload_resident_blocks": 2, "exec": "x"}', "unknown key", "config"),
    ('[2]', "JSON object", "config"),
    ('{"offload_resident_blocks": ' + "[" * 50 + "]" * 50 + "}", "nesting", "config"),
])
def test_residency_config_fields(tmp_path, content, text, path) -> None:
    from worldfoundry_resident_blocks.residency_config import read_residency_config

    file = tmp_path / "r.json"
    file.write_text(content)
    with pytest.raises(AccelerationOptionsError, match=text) as info:
        read_residency_config(file)
    assert info.value.path == path and str(file) in str(info.value)


def test_residency_config_special_files(tmp_path) -> None:
    from worldfoundry_resident_blocks.residency_config import read_residency_config

    with pytest.raises(AccelerationOptionsError, match="is a directory"):
        read_residency_config(tmp_path)
    if HAS_DEV_ZERO:
        with pytest.raises(AccelerationOptionsError, match="character device"):
            read_residency_config("/dev/zero")
    shipped = read_residency_config(ROOT / "recipes" / "residency" / "baseline.json")
    assert shipped["offload_resident_blocks"] == 0


def test_every_refusal_here_is_a_worldfoundry_error() -> None:
    for cls in (CalibrationArtifactError, NonFiniteWeightsError, AccelerationOptionsError, InvalidRequestError):
        assert issubclass(cls, WorldFoundryError)


def test_residency_config_errors_carry_the_callers_json_path(tmp_path) -> None:
    from worldfoundry_resident_blocks.residency_config import read_residency_config

    file = tmp_path / "r.json"
    file.write_text('{"offload_resident_blocks": true}')
    where = "candidates[0].accelerations.resident_blocks.config"
    with pytest.raises(AccelerationOptionsError) as info:
        read_residency_config(file, where=where)
    assert info.value.path == f"{where}.offload_resident_blocks"



def test_adapter_parser_refuses_meta_tensors_by_key(tiny_wan) -> None:
    from worldfoundry.base_models.diffusion_model.optimizations.attention_lora_format import parse_attention_lora

    q = tiny_wan.blocks[0].attn1.to_q
    state = {"blocks.0.attn1.to_q.lora_A.weight": torch.empty(4, q.in_features, device="meta"),
             "blocks.0.attn1.to_q.lora_B.weight": torch.zeros(q.out_features, 4)}
    with pytest.raises(ArtifactMismatchError, match="'blocks.0.attn1.to_q.lora_A.weight': on meta"):
        parse_attention_lora(tiny_wan, state, rank=4)
    state["blocks.0.attn1.to_q.lora_A.weight"] = torch.zeros(4, q.in_features)
    assert parse_attention_lora(tiny_wan, state, rank=4).paths == ("blocks.0.attn1.to_q",)
