"""FP8 calibration artifacts of the LightVAE student encoder: round trip, binding and mismatch refusals."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest
import torch

from worldfoundry.base_models.diffusion_model.codec import (
    load_wan_video_codec,
    random_wan_video_codec,
)
from worldfoundry.base_models.diffusion_model.codec_checkpoints import (
    to_original_state_dict,
)
from worldfoundry.base_models.diffusion_model.codec_fp8 import (
    ARTIFACT_FORMAT,
    calibrate_encoder_fp8,
    causal_convolutions,
    load_artifact,
    load_clip,
    save_artifact,
    select_convolutions,
    validate_artifact,
)
from worldfoundry.errors import ArtifactMismatchError, InvalidRequestError


def _clip(seed: int) -> torch.Tensor:
    return torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fp8")
    ckpt = root / "lightvaew2_1.pth"
    torch.save(to_original_state_dict(random_wan_video_codec("lightvae-wan21", seed=5).module.state_dict()), ckpt)
    clips = []
    for seed in (11, 12):
        torch.save(_clip(seed), root / f"calibration_{seed}.pt")
        clips.append(root / f"calibration_{seed}.pt")
    codec = load_wan_video_codec(ckpt, "lightvae-wan21", device="cpu")
    artifact = calibrate_encoder_fp8(codec, [(str(p), load_clip(p, 5)) for p in clips], include=["encoder.*"], frames=5)
    path = save_artifact(artifact, root / "lightvae-fp8.pt")
    return {"root": root, "ckpt": ckpt, "clips": clips, "codec": codec, "artifact": artifact, "path": path}


def test_artifact_round_trips_through_weights_only_load(setup):
    loaded = torch.load(setup["path"], weights_only=True)
    assert loaded["format"] == ARTIFACT_FORMAT and loaded["variant"] == "lightvae-wan21"
    assert loaded["checkpoint"]["sha256"] == hashlib.sha256(setup["ckpt"].read_bytes()).hexdigest()
    assert loaded["checkpoint"]["size_bytes"] == setup["ckpt"].stat().st_size
    sources = loaded["calibration"]["sources"]
    assert [s["path"] for s in sources] == [str(p) for p in setup["clips"]]
    assert sources[0]["sha256"] == hashlib.sha256(setup["clips"][0].read_bytes()).hexdigest()
    assert loaded["calibration"]["frames"] == 5 and loaded["calibration"]["include"] == ["encoder.*"]
    encoder = setup["codec"].module.encoder
    assert [k for k, _, _ in loaded["tensor_structure"]] == list(encoder.state_dict())
    convs = loaded["convolutions"]
    assert list(convs) == [p for p, _ in causal_convolutions(encoder)] and len(convs) == 26
    first = convs["encoder.conv_in"]
    assert first["geometry"] == {"in_channels": 3, "out_channels": 24, "kernel_size": [3, 3, 3],
                                 "stride": [1, 1, 1], "pad": [1, 1, 1, 1, 2, 0]}
    assert first["calls"] == 4  # two clips, two causal chunks each
    assert float(first["amax"]) == pytest.approx(max(float(_clip(s).abs().max()) for s in (11, 12)))
    assert convs["encoder.down_blocks.5.time_conv"]["calls"] == 2  # runs from the second chunk on
    bound = validate_artifact(load_artifact(setup["path"]), encoder, checkpoint_sha256=loaded["checkpoint"]["sha256"])
    assert [b.relative_path for b in bound][:2] == ["conv_in", "down_blocks.0.conv1"]


def test_calibration_leaves_the_codec_unchanged(setup):
    codec = setup["codec"]
    assert not any("_conv_forward" in m.__dict__ for _, m in causal_convolutions(codec.module.encoder))


def test_include_patterns_select_subsets(setup):
    encoder = setup["codec"].module.encoder
    picked = select_convolutions(encoder, ["encoder.down_blocks.*.conv1", "encoder.conv_out"])
    assert [p for p, _ in picked][-1] == "encoder.conv_out" and len(picked) == 9
    with pytest.raises(InvalidRequestError, match="match no encoder convolution"):
        select_convolutions(encoder, ["decoder.*"])


def test_other_weights_are_refused(setup):
    other = random_wan_video_codec("lightvae-wan21", seed=6).module.encoder
    with pytest.raises(ArtifactMismatchError, match="calibrated on encoder weights"):
        validate_artifact(setup["artifact"], other)


def test_other_checkpoint_file_is_refused_before_building(setup, tmp_path):
    state = torch.load(setup["ckpt"], weights_only=True)
    state["decoder.head.2.bias"] = state["decoder.head.2.bias"] + 1  # same encoder, different file
    other = tmp_path / "other.pth"
    torch.save(state, other)
    with pytest.raises(ArtifactMismatchError, match="calibrated on checkpoint SHA256"):
        load_wan_video_codec(other, "lightvae-wan21", device="cpu", fp8_calibration=setup["path"])


def test_geometry_structure_and_unknown_paths_are_refused(setup):
    encoder = setup["codec"].module.encoder
    bad_geometry = copy.deepcopy(setup["artifact"])
    bad_geometry["convolutions"]["encoder.conv_in"]["geometry"]["stride"] = [2, 1, 1]
    with pytest.raises(ArtifactMismatchError, match="encoder.conv_in geometry"):
        validate_artifact(bad_geometry, encoder)
    unknown = copy.deepcopy(setup["artifact"])
    unknown["convolutions"]["encoder.down_blocks.99.conv1"] = unknown["convolutions"]["encoder.conv_in"]
    with pytest.raises(ArtifactMismatchError, match="does not exist"):
        validate_artifact(unknown, encoder)
    structure = copy.deepcopy(setup["artifact"])
    structure["tensor_structure"][0][1] = [1]
    with pytest.raises(ArtifactMismatchError, match="tensor structure"):
        validate_artifact(structure, encoder)
    teacher_like = copy.deepcopy(encoder)
    teacher_like.conv_in = torch.nn.Conv3d(3, 96, 3)
    with pytest.raises(ArtifactMismatchError, match="base_dim 96"):
        validate_artifact(setup["artifact"], teacher_like)


def test_unreadable_or_foreign_artifacts_are_refused(setup, tmp_path):
    with pytest.raises(ArtifactMismatchError, match="does not exist"):
        load_artifact(tmp_path / "absent.pt")
    torch.save({"format": "worldfoundry-svdquant-v1"}, tmp_path / "svd.pt")
    with pytest.raises(ArtifactMismatchError, match="not a worldfoundry-lightvae-fp8-v1 artifact"):
        load_artifact(tmp_path / "svd.pt")
    partial = {k: v for k, v in setup["artifact"].items() if k != "convolutions"}
    torch.save(partial, tmp_path / "partial.pt")
    with pytest.raises(ArtifactMismatchError, match="lacks field"):
        load_artifact(tmp_path / "partial.pt")


def test_clip_files_are_validated(tmp_path: Path):
    torch.save({"video": torch.zeros(3, 9, 16, 16)}, tmp_path / "ok.pt")
    assert load_clip(tmp_path / "ok.pt", 5).shape == (1, 3, 5, 16, 16)
    torch.save(torch.zeros(9, 16, 16, 3, dtype=torch.uint8), tmp_path / "u8.pt")
    assert float(load_clip(tmp_path / "u8.pt", 9).min()) == -1.0
    with pytest.raises(InvalidRequestError, match="1 \\+ 4k"):
        load_clip(tmp_path / "ok.pt", 4)
    with pytest.raises(InvalidRequestError, match="fewer than"):
        load_clip(tmp_path / "ok.pt", 13)


def test_calibration_needs_the_fp32_student(setup):
    teacher_codec = random_wan_video_codec("lightvae-wan21", seed=5)
    teacher_codec.variant = type(teacher_codec.variant)("wan2.1", 96, "Wan2.1 VAE", False)
    with pytest.raises(InvalidRequestError, match="needs variant 'lightvae-wan21'"):
        calibrate_encoder_fp8(teacher_codec, [("c", _clip(1))], frames=5)
    with pytest.raises(InvalidRequestError, match="at least one calibration clip"):
        calibrate_encoder_fp8(setup["codec"], [], frames=5)
