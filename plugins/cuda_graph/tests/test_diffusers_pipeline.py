"""Through a diffusers ``WanPipeline`` (the user's own pipeline, not the native runner): the transformer's calls
replay one graph for both CFG branches, bitwise equal to the pipeline without the plugin."""

from __future__ import annotations

from typing import Any

import torch

from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations


def _pipeline(tools: Any) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    wan = tools.build_wan()
    return WanPipeline(tokenizer=None, text_encoder=None, transformer=wan.model, vae=None,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


def _generate(pipe: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    prompt, negative = torch.randn(1, 8, 32, generator=g), torch.randn(1, 8, 32, generator=g)
    return pipe(prompt_embeds=prompt, negative_prompt_embeds=negative, num_frames=5, height=32, width=32,
                num_inference_steps=3, guidance_scale=5.0, output_type="latent",
                generator=torch.Generator().manual_seed(0)).frames


def test_diffusers_pipeline_is_bitwise_with_one_graph(tools: Any) -> None:
    pipe = _pipeline(tools)
    pipe.set_progress_bar_config(disable=True)
    dense = _generate(pipe)
    session = install_diffusion_accelerations(pipe.transformer, {"cuda_graph": True},
                                              registry=tools.make_registry())
    latents = _generate(pipe)
    assert torch.equal(latents, dense)
    report = tools.graphs(session)
    assert report["totals"]["captures"] == 1 and report["totals"]["replays"] == 5
    assert len(report["signatures"]) == 1
    session.uninstall()
    assert torch.equal(_generate(pipe), dense)
