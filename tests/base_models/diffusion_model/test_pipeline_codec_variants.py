"""Selecting the LightVAE student codec through component options."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.errors import UnsupportedCodecOptionError

STUDENT = {"latent_encoder:codec": {"variant": "lightvae-wan21", "tiled": False, "dtype": torch.float32}}


@pytest.mark.parametrize("recipe", ["tiny-wan2.1", "tiny-sana-video"])
def test_student_codec_in_pipeline(recipe: str) -> None:
    with NativeDiffusionPipeline.from_pretrained(recipe, component_options=STUDENT) as pipe:
        assert pipe.components.codec.module.config.base_dim == 24
        result = pipe.generate(DiffusionRequest(prompt="x", num_inference_steps=2, output_type="np"))
    assert result.frames.shape == (5, 32, 32, 3)
    assert result.receipts["codec"]["algorithmically_approximate"] is True


def test_student_on_tiled_recipe_needs_tiled_false() -> None:
    with pytest.raises(UnsupportedCodecOptionError, match="tiled"):
        NativeDiffusionPipeline.from_pretrained("tiny-sana-video",
                                                component_options={"latent_encoder:codec": {"variant": "lightvae-wan21"}})


def test_fp8_calibration_requires_student() -> None:
    from worldfoundry.core.model_loading.policy import RuntimePolicy

    with pytest.raises(UnsupportedCodecOptionError, match="vae_fp8_calibration"):
        NativeDiffusionPipeline.from_pretrained(
            "tiny-wan2.1", component_options={"latent_encoder:codec": {"vae_fp8_calibration": "x.pt"}})
    with pytest.raises(UnsupportedCodecOptionError, match="vae_fp8_calibration"):
        NativeDiffusionPipeline.from_pretrained("tiny-wan2.1",
                                                policy=RuntimePolicy(options={"vae_fp8_calibration": "x.pt"}))
