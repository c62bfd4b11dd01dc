"""``WanVideoCodec`` against diffusers' ``AutoencoderKLWan`` used directly, cache resets, counters and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan

from worldfoundry.base_models.diffusion_model.codec import (
    REFUSED_OPTIONS,
    codec_from_component_options,
    load_wan_video_codec,
    random_wan_video_codec,
)
from worldfoundry.base_models.diffusion_model.codec_checkpoints import (
    to_original_state_dict,
)
from worldfoundry.errors import (
    CheckpointError,
    InvalidRequestError,
    ModelBusyError,
    UnsupportedCodecOptionError,
)


@pytest.fixture(scope="module")
def reference() -> AutoencoderKLWan:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return AutoencoderKLWan(base_dim=24).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, reference: AutoencoderKLWan) -> Path:
    path = tmp_path_factory.mktemp("codec") / "lightvaew2_1.pth"
    torch.save(to_original_state_dict(reference.state_dict()), path)
    return path


@pytest.fixture(scope="module")
def codec(checkpoint: Path):
    return load_wan_video_codec(checkpoint, "lightvae-wan21", device="cpu", dtype=torch.float32)


def _video(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, 5, 32, 32, generator=g) * 2 - 1


def _stats(model: AutoencoderKLWan) -> tuple[torch.Tensor, torch.Tensor]:
    # exactly as diffusers' WanPipeline builds them
    mean = torch.tensor(model.config.latents_mean).view(1, model.config.z_dim, 1, 1, 1).to("cpu", torch.float32)
    inv_std = 1.0 / torch.tensor(model.config.latents_std).view(1, model.config.z_dim, 1, 1, 1).to("cpu", torch.float32)
    return mean, inv_std


def test_encode_and_decode_are_bitwise_equal_to_diffusers(codec, reference):
    video = _video()
    mean, inv_std = _stats(reference)
    latents = codec.encode(video)
    with torch.no_grad():
        expected = (reference.encode(video).latent_dist.mode() - mean) * inv_std
    assert latents.shape == (1, 16, 2, 4, 4)
    assert torch.equal(latents, expected)
    decoded = codec.decode(latents)
    with torch.no_grad():
        expected_video = reference.decode(latents / inv_std + mean, return_dict=False)[0]
    assert decoded.shape == (1, 3, 5, 32, 32) and decoded.dtype == torch.float32
    assert torch.equal(decoded, expected_video)
    assert decoded.min() >= -1 and decoded.max() <= 1


def test_wan16_statistics_come_from_the_diffusers_config(codec, reference):
    assert codec.module.config.latents_mean == reference.config.latents_mean
    assert codec.module.config.latents_std == reference.config.latents_std
    raw = torch.randn(1, 16, 1, 2, 2)
    assert torch.allclose(codec.denormalize(codec.normalize(raw)), raw, atol=1e-6)


def test_repeated_calls_reset_the_causal_cache(codec):
    a, b = _video(1), _video(2)
    first = codec.encode(a)
    assert all(entry is None for entry in codec.module._enc_feat_map)
    codec.encode(b)
    assert torch.equal(codec.encode(a), first)  # b's features did not leak into a's second encode
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(5))
    once = codec.decode(latents)
    assert all(entry is None for entry in codec.module._feat_map)
    codec.decode(torch.randn(1, 16, 2, 4, 4))
    assert torch.equal(codec.decode(latents), once)


def test_cache_is_cleared_after_a_failed_call(codec):
    video = _video(4)
    expected = codec.encode(video)
    calls = {"n": 0}

    def fail_on_second_chunk(module, args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("interrupted")

    handle = codec.module.encoder.register_forward_pre_hook(fail_on_second_chunk)
    try:
        with pytest.raises(RuntimeError, match="interrupted"):
            codec.encode(video)
    finally:
        handle.remove()
    assert all(entry is None for entry in codec.module._enc_feat_map)
    assert torch.equal(codec.encode(video), expected)


def test_execution_counters_and_report(checkpoint):
    fresh = load_wan_video_codec(checkpoint, "lightvae-wan21", device="cpu")
    latents = fresh.encode(_video())
    fresh.decode(latents)
    fresh.decode(latents)
    report = fresh.execution_report()
    assert report["calls"] == {"encode": 1, "decode": 2}
    assert report["frames"] == {"encoded": 5, "decoded": 10}
    assert report["algorithmically_approximate"] is True
    assert report["variant"] == "lightvae-wan21" and report["base_dim"] == 24
    assert report["feature_channels"] == [24, 48, 96] and report["z_dim"] == 16
    assert report["source"]["path"] == str(checkpoint) and report["fp8_encoder"] is None
    assert report["last_shapes"] == {"encode": [1, 16, 2, 4, 4], "decode": [1, 3, 5, 32, 32]}


def test_random_codec_is_seeded():
    a = random_wan_video_codec("lightvae-wan21", seed=7)
    b = random_wan_video_codec("lightvae-wan21", seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.module.state_dict().values(), b.module.state_dict().values(),
                                                  strict=True))
    assert a.execution_report()["random_weights"] is True


@pytest.mark.parametrize("shape", [(1, 3, 4, 32, 32), (1, 3, 5, 30, 32), (1, 4, 5, 32, 32), (3, 5, 32, 32)])
def test_encode_validates_the_video_shape(codec, shape):
    with pytest.raises(InvalidRequestError):
        codec.encode(torch.zeros(shape))


def test_decode_validates_the_latent_shape(codec):
    with pytest.raises(InvalidRequestError, match=r"\(B, 16, T, h, w\)"):
        codec.decode(torch.zeros(1, 48, 1, 2, 2))


def test_concurrent_use_is_refused(codec):
    codec._lock.acquire()
    try:
        with pytest.raises(ModelBusyError, match="encode with the video codec"):
            codec.encode(_video())
    finally:
        codec._lock.release()


def test_autocast_is_refused_at_call_time(codec):
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UnsupportedCodecOptionError, match="autocast"):
        codec.decode(torch.zeros(1, 16, 1, 2, 2))


# ------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("option", sorted(REFUSED_OPTIONS))
def test_refused_options_are_named(checkpoint, option):
    with pytest.raises(UnsupportedCodecOptionError) as info:
        load_wan_video_codec(checkpoint, "lightvae-wan21", device="cpu", **{option: True})
    assert info.value.option == option and repr(option) in str(info.value)


def test_switched_off_options_are_accepted(checkpoint):
    codec = load_wan_video_codec(checkpoint, "lightvae-wan21", device="cpu", tiled=False, offload=None,
                                 compile=False, sp="off")
    assert codec.tiled is False


@pytest.mark.parametrize("kwargs, option", [
    ({"dtype": torch.bfloat16}, "dtype"),
    ({"dtype": "fp16"}, "dtype"),
    ({"purpose": "training"}, "purpose"),
    ({"use_slicing": True}, "use_slicing"),
    ({"fp8_backend": "int8"}, "fp8_backend"),
])
def test_low_precision_purpose_and_unknown_options_are_refused(checkpoint, kwargs, option):
    with pytest.raises(UnsupportedCodecOptionError) as info:
        load_wan_video_codec(checkpoint, "lightvae-wan21", device="cpu", **kwargs)
    assert info.value.option == option


def test_refusals_happen_before_reading_the_file(tmp_path):
    with pytest.raises(UnsupportedCodecOptionError, match="tiled"):
        load_wan_video_codec(tmp_path / "absent.pth", "lightvae-wan21", device="cpu", tiled=True)


def test_fp8_calibration_requires_the_student(checkpoint, tmp_path):
    with pytest.raises(UnsupportedCodecOptionError, match="vae_fp8_calibration.*lightvae-wan21"):
        load_wan_video_codec(checkpoint, "wan2.1", device="cpu", fp8_calibration=tmp_path / "a.pt")


def test_unknown_variant(checkpoint):
    with pytest.raises(CheckpointError, match="known variants: wan2.1, lightvae-wan21"):
        load_wan_video_codec(checkpoint, "lightvae-wan22", device="cpu")


# ------------------------------------------------------------------------------------------- component options


def test_component_options_build_the_student(checkpoint, reference):
    codec = codec_from_component_options(
        checkpoint, {"variant": "lightvae-wan21", "tiled": False, "dtype": torch.float32}, "cpu"
    )
    assert codec.variant.name == "lightvae-wan21"
    assert all(torch.equal(codec.module.state_dict()[k], v) for k, v in reference.state_dict().items())


def test_tiled_by_default_recipe_needs_explicit_tiled_false(checkpoint):
    with pytest.raises(UnsupportedCodecOptionError, match="defaults to a tiled codec.*'tiled': False") as info:
        codec_from_component_options(checkpoint, {"variant": "lightvae-wan21", "dtype": torch.float32}, "cpu",
                                     recipe_default_tiled=True)
    assert info.value.option == "tiled"
    with pytest.raises(UnsupportedCodecOptionError, match="tiled"):
        codec_from_component_options(checkpoint, {"variant": "lightvae-wan21", "tiled": True}, "cpu",
                                     recipe_default_tiled=True)
    codec = codec_from_component_options(checkpoint, {"variant": "lightvae-wan21", "tiled": False}, "cpu",
                                         recipe_default_tiled=True)
    assert codec.tiled is False


def test_component_options_fp8_and_dtype_rules(checkpoint, tmp_path):
    with pytest.raises(UnsupportedCodecOptionError, match="vae_fp8_calibration"):
        codec_from_component_options(checkpoint, {"tiled": False}, "cpu",
                                     runtime_options={"vae_fp8_calibration": str(tmp_path / "a.pt")})
    with pytest.raises(UnsupportedCodecOptionError, match="dtype"):
        codec_from_component_options(checkpoint, {"variant": "lightvae-wan21"}, "cpu",
                                     runtime_options={"vae_dtype": torch.bfloat16})
    with pytest.raises(UnsupportedCodecOptionError, match="group_offload"):
        codec_from_component_options(checkpoint, {"variant": "lightvae-wan21", "group_offload": True}, "cpu")


def test_component_options_without_a_path_give_seeded_random_weights():
    a = codec_from_component_options(None, {"variant": "lightvae-wan21", "seed": 4}, "cpu")
    b = random_wan_video_codec("lightvae-wan21", seed=4)
    assert a.source is None
    assert all(torch.equal(x, y) for x, y in zip(a.module.state_dict().values(), b.module.state_dict().values(),
                                                  strict=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_refused_by_name(checkpoint):
    with pytest.raises(UnsupportedCodecOptionError, match="CUDA is not available") as info:
        load_wan_video_codec(checkpoint, "lightvae-wan21")  # the default device is "cuda"
    assert info.value.option == "device"
