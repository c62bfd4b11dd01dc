"""Through the native runner (NativeDiffusionPipeline): bitwise latents, one graph for both CFG branches, receipts
per request, the request guard unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from worldfoundry_cuda_graph.plugin import prepare

from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.core.acceleration.cuda_graph import NO_CUDA_DEVICE
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy

STEPS = 3


def _request(request_id: str) -> DiffusionRequest:
    return DiffusionRequest(prompt="a red ball", num_frames=5, height=32, width=32, num_inference_steps=STEPS,
                            guidance_scale=5.0, seed=42, request_id=request_id, output_type="latent")


@pytest.mark.parametrize("stack", [{}, {"wan_cross_kv_fusion": {"min_tokens": 0}}], ids=["alone", "static_kv"])
def test_generate_is_bitwise_with_one_graph_for_both_branches(tools: Any, stack: dict[str, Any]) -> None:
    registry = tools.make_registry()
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=RuntimePolicy(), registry=registry) as pipe:
        denoiser = pipe.components.denoiser
        if stack:
            denoiser.install(stack, registry=registry)
        dense = pipe.generate(_request("dense")).latents
        if stack:
            denoiser.uninstall()
        denoiser.install({**stack, "cuda_graph": {}}, registry=registry)
        first = pipe.generate(_request("g1"))
        second = pipe.generate(_request("g2"))
        assert torch.equal(first.latents, dense) and torch.equal(second.latents, dense)
        record = second.receipts["plugins"]["cuda_graph"]["model"]
        replays = record["modules"]["<root>"]["replay"]
        assert replays == (2 * STEPS - 2 if stack else 2 * STEPS)
        assert record["finished"] and record["notes"]["signatures"] == 1
        guard = denoiser.model._worldfoundry_guard
        assert guard.active_request_ids() == () or list(guard.active_request_ids()) == []
        denoiser.uninstall()


def test_registered_plugin_on_cpu_runs_eagerly_with_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    registry = AccelerationRegistry(discover=False)
    registry.register("cuda_graph", prepare)
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=RuntimePolicy(), registry=registry,
                                                 accelerations={"cuda_graph": {}}) as pipe:
        result = pipe.generate(_request("r1"))
        record = result.receipts["plugins"]["cuda_graph"]["model"]
        assert record["fallbacks"] == {NO_CUDA_DEVICE: 2 * STEPS}
        pipe.components.denoiser.uninstall()
        assert torch.equal(pipe.generate(_request("dense")).latents, result.latents)


def test_routed_experts_each_keep_their_graphs(tools: Any) -> None:
    registry = tools.make_registry()
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.2-a14b", policy=RuntimePolicy(),
                                                 registry=registry) as pipe:
        denoiser = pipe.components.denoiser
        dense = pipe.generate(_request("dense")).latents
        denoiser.install({"cuda_graph": {}}, registry=registry)
        result = pipe.generate(_request("g1"))
        assert torch.equal(result.latents, dense)
        records = result.receipts["plugins"]["cuda_graph"]
        assert set(records) == {"high", "low"}
        calls = sum(sum(r["modules"].get("<root>", {}).values()) for r in records.values())
        assert calls == 2 * STEPS and all(not r["fallbacks"] for r in records.values())
        denoiser.uninstall()
