"""The shipped trained model loads offline, is deterministic, and has learned colour from captions."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "fixtures"))
from procedural_videos import dominant_colour  # noqa: E402

STEPS = 8


def _colours(pipe: NativeDiffusionPipeline, caption: str, seeds: range) -> list[str]:
    out = []
    for seed in seeds:
        frames = pipe.generate(DiffusionRequest(prompt=caption, seed=seed, num_inference_steps=STEPS,
                                                output_type="np")).frames
        video = torch.from_numpy(frames).float().permute(3, 0, 1, 2) / 127.5 - 1.0
        out.append(dominant_colour(video))
    return out


def test_trained_recipe_loads_offline_and_is_deterministic() -> None:
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1-trained") as pipe:
        kinds = {s.component: s.kind for s in pipe.components.sources}
        assert kinds["denoiser:model"] == "diffusers_dir" and pipe.components.random_weights is False
        a = pipe.generate(DiffusionRequest(prompt="a blue circle bouncing", seed=3, num_inference_steps=2))
        b = pipe.generate(DiffusionRequest(prompt="a blue circle bouncing", seed=3, num_inference_steps=2))
    assert torch.equal(a.latents, b.latents)


def test_trained_model_follows_colour_words_and_a_random_model_does_not() -> None:
    seeds = range(3)
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1-trained") as pipe:
        red = _colours(pipe, "a red square moving left", seeds)
        green = _colours(pipe, "a green bar moving up", seeds)
    assert red.count("red") >= 2, red
    assert green.count("green") >= 2, green
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1-trained", random_weights=True) as pipe:
        assert pipe.components.random_weights is True
        random_red = _colours(pipe, "a red square moving left", seeds)
    assert random_red.count("red") < 2, random_red
