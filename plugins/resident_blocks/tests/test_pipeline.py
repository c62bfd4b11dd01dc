"""End to end through the native pipeline on the offline tiny recipes (CPU, emulated mode)."""

from __future__ import annotations

import pytest
import torch

pipeline = pytest.importorskip("worldfoundry.base_models.diffusion_model.pipeline")

from worldfoundry.core.model_loading.policy import RuntimePolicy  # noqa: E402

REQUEST = dict(prompt="a red ball", num_frames=5, height=32, width=32, num_inference_steps=3, guidance_scale=5.0,
               seed=42, output_type="latent")


def _generate(recipe: str, accelerations, request_id: str):
    policy = RuntimePolicy(device="cpu", dtype=torch.float32)
    with pipeline.NativeDiffusionPipeline.from_pretrained(recipe, policy=policy, accelerations=accelerations) as pipe:
        result = pipe.generate(pipeline.DiffusionRequest(request_id=request_id, **REQUEST))
        experts = list(pipe.components.denoiser.experts)
    return result, experts


@pytest.mark.parametrize("r, contiguous", [(0, False), (1, True)])
def test_tiny_wan21_bitwise_with_receipts(r: int, contiguous: bool) -> None:
    dense, _ = _generate("tiny-wan2.1", None, "dense")
    spec = {"resident_blocks": {"offload_resident_blocks": r, "cpu_offload_block_contiguous": contiguous}}
    offloaded, _ = _generate("tiny-wan2.1", spec, "off")
    assert torch.equal(offloaded.latents, dense.latents)
    record = offloaded.receipts["plugins"]["resident_blocks"]["model"]
    receipt = record["notes"]["offload"]
    n = receipt["num_blocks"]
    assert receipt["emulated"] is True and receipt["resident_count"] == r
    assert receipt["forwards"] == 2 * REQUEST["num_inference_steps"]  # CFG: two branches per step
    assert receipt["transfers_per_forward"] == [n - r] * receipt["forwards"]
    assert receipt["resident_builds"] == (1 if r else 0)
    assert record["finished"] is True
    assert all(f"blocks.{i}" in record["modules"] for i in range(n))
    assert offloaded.receipts["installed"]["plugins"][0]["exact"] is True


def test_tiny_wan22_two_experts_bitwise() -> None:
    dense, experts = _generate("tiny-wan2.2-a14b", None, "dense")
    offloaded, _ = _generate("tiny-wan2.2-a14b", {"resident_blocks": {"offload_resident_blocks": 1}}, "off")
    assert torch.equal(offloaded.latents, dense.latents)
    per_expert = offloaded.receipts["plugins"]["resident_blocks"]
    assert set(per_expert) == set(experts) == {"high", "low"}
    forwards = sum(per_expert[e]["notes"]["offload"]["forwards"] for e in experts)
    assert forwards == 2 * REQUEST["num_inference_steps"]


def test_tiny_sana_video_bitwise() -> None:
    request = dict(REQUEST, num_inference_steps=2)
    policy = RuntimePolicy(device="cpu", dtype=torch.float32)
    latents = {}
    for name, spec in (("dense", None), ("off", {"resident_blocks": {"offload_resident_blocks": 1,
                                                                      "cpu_offload_block_contiguous": True}})):
        with pipeline.NativeDiffusionPipeline.from_pretrained("tiny-sana-video", policy=policy,
                                                              accelerations=spec) as pipe:
            result = pipe.generate(pipeline.DiffusionRequest(request_id=name, **{
                k: v for k, v in request.items() if k not in ("num_frames", "height", "width")}))
            latents[name] = result.latents
    assert torch.equal(latents["off"], latents["dense"])
    receipt = result.receipts["plugins"]["resident_blocks"]["model"]["notes"]["offload"]
    assert receipt["transfers_per_forward"] == [receipt["num_blocks"] - 1] * receipt["forwards"]
