"""End to end through NativeDiffusionPipeline (tiny Wan 2.1 recipe, CFG): bitwise latents, receipts per request."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.core.model_loading.policy import RuntimePolicy

pytestmark = pytest.mark.usefixtures("kernels")


def test_generate_is_bitwise_with_block_fusion(kit, kernels) -> None:  # noqa: ANN001
    registry = kit.make_registry()
    steps = 2
    request = DiffusionRequest(prompt="a red ball", num_frames=5, height=32, width=32, num_inference_steps=steps,
                               guidance_scale=5.0, seed=42, request_id="dense", output_type="latent")
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=RuntimePolicy(device=str(kernels)),
                                              registry=registry) as pipe:
        dense = pipe.generate(request).latents
        pipe.components.denoiser.install({"wan_block_fusion": {}}, registry=registry)
        result = pipe.generate(DiffusionRequest(**{**request.__dict__, "request_id": "fused"}))
    assert torch.equal(result.latents, dense)
    assert result.receipts["installed"]["exact"] is True
    record = result.receipts["plugins"]["wan_block_fusion"]["model"]
    blocks = 2
    assert record["counters"]["gated_residual"] == 2 * blocks * 2 * steps  # two per block, per CFG branch and step
    assert record["fallbacks"] == {} and record["claimed_not_executed"] == []
