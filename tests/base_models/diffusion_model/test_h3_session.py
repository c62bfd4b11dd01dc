"""MiniMax-H3 conditioning bundles: round trip, integrity, structure checks, runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from worldfoundry.base_models.diffusion_model.h3_session import (
    H3Bundle,
    build_random_h3_bundle,
    load_h3_bundle,
)
from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.core.model_loading.recipes import load_recipe
from worldfoundry.errors import ArtifactMismatchError

CONFIG = dict(load_recipe("tiny-minimax-h3").denoiser.config)


def test_bundle_round_trip_and_generation(tmp_path: Path) -> None:
    bundle = build_random_h3_bundle(CONFIG, seed=1)
    bundle.save(tmp_path / "b")
    loaded = load_h3_bundle(tmp_path / "b")
    for key, value in bundle.tensors.items():
        assert torch.equal(loaded[key], value), key
    with NativeDiffusionPipeline.from_pretrained("tiny-minimax-h3") as pipe:
        from_dir = pipe.generate(DiffusionRequest(bundle=str(tmp_path / "b"), seed=0))
        in_memory = pipe.generate(DiffusionRequest(bundle=bundle, seed=0))
    assert torch.equal(from_dir.latents, in_memory.latents)
    video = from_dir.latents
    target = bundle["video_target_mask"].bool()
    # conditioning rows are never denoised: they come back exactly as given
    assert torch.equal(video[:, ~target], bundle["video_latents"][:, ~target])
    assert not torch.equal(video[:, target], bundle["video_latents"][:, target])
    assert from_dir.audio_latents.shape == bundle["audio_latents"].shape


def test_tampered_bundle_is_rejected(tmp_path: Path) -> None:
    build_random_h3_bundle(CONFIG, seed=2).save(tmp_path / "b")
    data = tmp_path / "b" / "bundle.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ArtifactMismatchError, match="SHA256"):
        load_h3_bundle(tmp_path / "b")


def test_manifest_tensor_hash_mismatch(tmp_path: Path) -> None:
    build_random_h3_bundle(CONFIG, seed=2).save(tmp_path / "b")
    manifest_path = tmp_path / "b" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tensors"]["text_embeds"]["sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactMismatchError, match="text_embeds"):
        load_h3_bundle(tmp_path / "b")


def test_structure_errors() -> None:
    good = build_random_h3_bundle(CONFIG, seed=3)
    bad_tags = dict(good.tensors)
    bad_tags["token_tags"] = torch.zeros_like(good["token_tags"])
    with pytest.raises(ArtifactMismatchError, match="token_tags"):
        H3Bundle(bad_tags, {}).validate()
    wrong_channels = build_random_h3_bundle({**CONFIG, "text_dim": 16}, seed=3)
    with pytest.raises(ArtifactMismatchError, match="text_embeds"):
        wrong_channels.validate(CONFIG)
    missing = {k: v for k, v in good.tensors.items() if k != "position_ids"}
    with pytest.raises(ArtifactMismatchError, match="missing"):
        H3Bundle(missing, {}).validate()
