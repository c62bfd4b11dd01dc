"""Strict Wan2.1 codec checkpoint reading: key tables, formats, identification and the published-file hash.

Synthetic checkpoints are written in the original Wan layout from seeded ``AutoencoderKLWan`` models
(student) or from stride-0 expanded tensors with the real shapes (teacher, Wan2.2), which keeps files tiny.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from safetensors.torch import save_file

from worldfoundry.base_models.diffusion_model.codec import load_wan_video_codec
from worldfoundry.base_models.diffusion_model.codec_checkpoints import (
    ORIGINAL_KEY_COUNT,
    STUDENT_PUBLISHED_SHA256,
    STUDENT_PUBLISHED_SIZE,
    diffusers_shape_table,
    identify,
    original_key,
    original_key_table,
    to_original_state_dict,
)
from worldfoundry.errors import CheckpointError, MissingWeightsError


def _student_model(seed: int = 0) -> AutoencoderKLWan:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKLWan(base_dim=24).eval()


def _expanded(shapes: dict[str, tuple[int, ...]], value: float = 0.01) -> dict[str, torch.Tensor]:
    """Tensors with the given shapes that store one element each (stride 0), so files stay small."""
    return {k: torch.full((), value).expand(*s) for k, s in shapes.items()}


def _wan22_shapes() -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12,
                                 out_channels=12, patch_size=2, scale_factor_spatial=16)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, AutoencoderKLWan]:
    model = _student_model()
    path = tmp_path_factory.mktemp("student") / "lightvaew2_1.pth"
    torch.save(to_original_state_dict(model.state_dict()), path)
    return path, model


# ------------------------------------------------------------------------------------------- key tables


@pytest.mark.parametrize("base_dim", [24, 96])
def test_original_key_table_has_194_keys_and_round_trips_through_diffusers_conversion(base_dim):
    table = original_key_table(base_dim)
    assert len(table) == ORIGINAL_KEY_COUNT == 194
    converted = convert_wan_vae_to_diffusers({k: k for k in table})
    shapes = diffusers_shape_table(base_dim)
    assert set(converted) == set(shapes)
    assert all(table[orig] == shapes[diff] for diff, orig in converted.items())
    assert table["encoder.conv1.weight"] == (base_dim, 3, 3, 3, 3)
    assert table["conv2.weight"] == (16, 16, 1, 1, 1)


def test_student_table_has_24_48_96_channels_and_11_encoder_down_blocks():
    table = original_key_table(24)
    assert table["encoder.downsamples.0.residual.2.weight"][0] == 24
    assert table["encoder.downsamples.3.residual.2.weight"][0] == 48
    assert table["encoder.downsamples.6.residual.2.weight"][0] == 96
    blocks = {int(k.split(".")[2]) for k in table if k.startswith("encoder.downsamples.")}
    assert blocks == set(range(11))


@pytest.mark.parametrize("diffusers_key, expected", [
    ("decoder.up_blocks.1.resnets.0.conv_shortcut.weight", "decoder.upsamples.4.shortcut.weight"),
    ("decoder.up_blocks.2.upsamplers.0.resample.1.bias", "decoder.upsamples.11.resample.1.bias"),
    ("encoder.down_blocks.5.time_conv.weight", "encoder.downsamples.5.time_conv.weight"),
    ("encoder.mid_block.resnets.1.norm2.gamma", "encoder.middle.2.residual.3.gamma"),
    ("decoder.mid_block.attentions.0.to_qkv.weight", "decoder.middle.1.to_qkv.weight"),
    ("post_quant_conv.bias", "conv2.bias"),
])
def test_original_key_inverts_the_conversion(diffusers_key, expected):
    assert original_key(diffusers_key) == expected
    assert convert_wan_vae_to_diffusers({expected: 0}) == {diffusers_key: 0}


def test_original_key_rejects_foreign_keys():
    with pytest.raises(CheckpointError, match="not a key"):
        original_key("blocks.0.attn1.to_q.weight")


# ------------------------------------------------------------------------------------------- strictness


def test_strict_student_load_matches_the_written_weights(student):
    path, model = student
    codec = load_wan_video_codec(path, "lightvae-wan21", device="cpu")
    loaded = codec.module.state_dict()
    assert list(loaded) == list(model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    src = codec.source.to_json()
    assert src["format"] == "original-pth" and src["tensor_count"] == 194
    assert src["published_checkpoint"] is None and src["sha256"] is None  # size differs from the published file
    assert "differs from the published" in src["notes"][0]


def test_missing_unexpected_and_wrong_shape_keys_are_named(tmp_path, student):
    path, _ = student
    original = torch.load(path, weights_only=True)
    missing = dict(original)
    del missing["decoder.head.2.weight"]
    torch.save(missing, tmp_path / "missing.pth")
    with pytest.raises(CheckpointError, match=r"1 missing key\(s\).*decoder\.head\.2\.weight"):
        load_wan_video_codec(tmp_path / "missing.pth", "lightvae-wan21", device="cpu")
    extra = {**original, "decoder.extra.weight": torch.zeros(1)}
    torch.save(extra, tmp_path / "extra.pth")
    with pytest.raises(CheckpointError, match=r"unexpected key\(s\).*decoder\.extra\.weight"):
        load_wan_video_codec(tmp_path / "extra.pth", "lightvae-wan21", device="cpu")
    wrong = {**original, "encoder.downsamples.0.residual.2.weight": torch.zeros(24, 24, 1, 3, 3)}
    torch.save(wrong, tmp_path / "wrong.pth")
    with pytest.raises(CheckpointError, match=r"shape mismatch.*encoder\.downsamples\.0\.residual\.2\.weight"):
        load_wan_video_codec(tmp_path / "wrong.pth", "lightvae-wan21", device="cpu")


def test_teacher_given_as_student_is_rejected_with_what_it_is(tmp_path):
    path = tmp_path / "Wan2.1_VAE.pth"
    torch.save(_expanded(original_key_table(96)), path)
    assert path.stat().st_size < 200_000
    with pytest.raises(CheckpointError, match=r"Wan2\.1 VAE \(teacher, base_dim 96\).*not the LightVAE.*variant='wan2\.1'"):
        load_wan_video_codec(path, "lightvae-wan21", device="cpu")


def test_student_given_as_teacher_is_rejected(student):
    path, _ = student
    with pytest.raises(CheckpointError, match=r"LightVAE Wan2\.1 student.*not the Wan2\.1 VAE.*variant='lightvae-wan21'"):
        load_wan_video_codec(path, "wan2.1", device="cpu")


def test_wan22_48_channel_vae_is_rejected_in_both_layouts(tmp_path):
    shapes = _wan22_shapes()
    torch.save(_expanded(shapes), tmp_path / "wan22_diffusers.pth")
    with pytest.raises(CheckpointError, match=r"Wan2\.2 VAE \(48 latent channels"):
        load_wan_video_codec(tmp_path / "wan22_diffusers.pth", "lightvae-wan21", device="cpu")
    # Original Wan2.2 naming of the tensors identification reads (encoder.conv1, conv1, conv2, decoder.conv1).
    renamed = {"encoder.conv_in.weight": "encoder.conv1.weight", "quant_conv.weight": "conv1.weight",
               "post_quant_conv.weight": "conv2.weight", "decoder.conv_in.weight": "decoder.conv1.weight"}
    original = _expanded({renamed.get(k, k): s for k, s in shapes.items()})
    torch.save(original, tmp_path / "Wan2.2_VAE.pth")
    identity = identify(original)
    assert (identity.layout, identity.z_dim, identity.in_channels) == ("original", 48, 12)
    with pytest.raises(CheckpointError, match=r"is a Wan2\.2 VAE"):
        load_wan_video_codec(tmp_path / "Wan2.2_VAE.pth", "lightvae-wan21", device="cpu")
    with pytest.raises(CheckpointError, match=r"is a Wan2\.2 VAE"):
        load_wan_video_codec(tmp_path / "Wan2.2_VAE.pth", "wan2.1", device="cpu")


def test_teacher_loads_through_the_original_layout(tmp_path):
    path = tmp_path / "teacher.pth"
    torch.save(_expanded(original_key_table(96)), path)
    codec = load_wan_video_codec(path, "wan2.1", device="cpu")
    report = codec.execution_report()
    assert report["variant"] == "wan2.1" and report["algorithmically_approximate"] is False
    assert report["feature_channels"] == [96, 192, 384]
    video = codec.decode(torch.zeros(1, 16, 1, 2, 2))
    assert video.shape == (1, 3, 1, 16, 16) and bool(torch.isfinite(video).all())


# ------------------------------------------------------------------------------------------- formats


def test_safetensors_and_diffusers_layouts_load_the_same_weights(tmp_path, student):
    path, model = student
    state = model.state_dict()
    save_file({k: v.contiguous() for k, v in torch.load(path, weights_only=True).items()}, tmp_path / "orig.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "diff.safetensors")
    directory = tmp_path / "pipeline" / "vae"
    directory.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, directory / "diffusion_pytorch_model.safetensors")
    (directory / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", **dict(model.config)}))
    formats = {}
    for source in (tmp_path / "orig.safetensors", tmp_path / "diff.safetensors", tmp_path / "pipeline"):
        codec = load_wan_video_codec(source, "lightvae-wan21", device="cpu")
        formats[source.name] = codec.source.format
        assert all(torch.equal(codec.module.state_dict()[k], v) for k, v in state.items())
    assert formats == {"orig.safetensors": "original-safetensors", "diff.safetensors": "diffusers-safetensors",
                       "pipeline": "diffusers-directory"}


def test_diffusers_directory_with_another_config_is_rejected(tmp_path, student):
    _, model = student
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "diffusion_pytorch_model.safetensors")
    config = {"_class_name": "AutoencoderKLWan", **dict(model.config), "latents_mean": [0.0] * 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="latents_mean"):
        load_wan_video_codec(tmp_path, "lightvae-wan21", device="cpu")


def test_pickled_objects_are_refused_by_weights_only(tmp_path):
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"encoder.conv1.weight": _Payload()}, f)
    with pytest.raises(CheckpointError, match=r"weights_only=True"):
        load_wan_video_codec(path, "lightvae-wan21", device="cpu")


class _Payload:
    pass


def test_missing_file_and_unknown_suffix(tmp_path):
    missing = tmp_path / "nowhere" / "lightvaew2_1.pth"
    with pytest.raises(MissingWeightsError, match=str(missing).replace(".", r"\.")) as info:
        load_wan_video_codec(missing, "lightvae-wan21", device="cpu")
    assert isinstance(info.value, FileNotFoundError)
    (tmp_path / "vae.onnx").write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="unsupported codec file type '.onnx'"):
        load_wan_video_codec(tmp_path / "vae.onnx", "lightvae-wan21", device="cpu")


# ------------------------------------------------------------------------------------------- published hash


def test_published_constants():
    assert STUDENT_PUBLISHED_SIZE == 32_208_043
    assert STUDENT_PUBLISHED_SHA256 == "d5d6b094d4829fb03b6179be2cf4589baab21c9fea1ca70dcaa8c85ba8183ec9"


def test_hash_is_verified_and_recorded_when_the_size_matches(student):
    path, _ = student
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    size = path.stat().st_size
    codec = load_wan_video_codec(path, "lightvae-wan21", device="cpu", published_size=size, published_sha256=digest)
    assert codec.source.sha256 == digest and codec.source.published_checkpoint is True
    wrong = "0" * 64
    with pytest.raises(CheckpointError, match=f"has the published .*size .*SHA256 {digest}, expected {wrong}"):
        load_wan_video_codec(path, "lightvae-wan21", device="cpu", published_size=size, published_sha256=wrong)
    other_size = load_wan_video_codec(path, "lightvae-wan21", device="cpu", published_size=size + 1,
                                      published_sha256=wrong)
    assert other_size.source.published_checkpoint is None and other_size.source.sha256 is None
