"""End to end through NativeDiffusionPipeline: the runner's request context drives the step range, receipts
are per request, Wan2.2's two experts are both routed, uninstall restores the latents bitwise."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.core.model_loading.policy import RuntimePolicy

TEST_PROVIDER = "chunked_softmax"
STEPS = 4


def _request(request_id: str) -> DiffusionRequest:
    return DiffusionRequest(prompt="a red ball", num_frames=5, height=32, width=32, guidance_scale=5.0,
                            num_inference_steps=STEPS, seed=42, request_id=request_id, output_type="latent")


@pytest.mark.parametrize("recipe", ["tiny-wan2.1", "tiny-wan2.2-a14b"])
def test_step_range_follows_the_runner(recipe: str, registry) -> None:  # noqa: ANN001
    with NativeDiffusionPipeline.from_pretrained(recipe, policy=RuntimePolicy(), registry=registry) as pipe:
        denoiser = pipe.components.denoiser
        dense = pipe.generate(_request("dense")).latents
        spec = {"attention_policy": {"self": {"backend": TEST_PROVIDER, "dense_first_steps": 1,
                                              "dense_last_steps": 1}}}
        denoiser.install(spec, registry=registry)
        result = pipe.generate(_request("r1"))
        torch.testing.assert_close(result.latents, dense, rtol=1e-3, atol=1e-4)
        assert result.receipts["installed"]["exact"] is False
        executed = fallbacks = 0
        for expert, record in result.receipts["plugins"]["attention_policy"].items():
            assert record["finished"] is True, expert
            executed += record["counters"].get(TEST_PROVIDER, 0)
            fallbacks += record["counters"].get("dense_fallback", 0)
            assert set(record["fallbacks"]) <= {"self: dense step (outside the step range)"}
        # every step runs both CFG branches; steps 0 and 3 are dense, steps 1 and 2 run the provider
        assert executed == fallbacks > 0
        denoiser.uninstall()
        assert torch.equal(pipe.generate(_request("again")).latents, dense)
