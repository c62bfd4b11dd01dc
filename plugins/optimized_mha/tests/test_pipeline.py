"""End to end through NativeDiffusionPipeline: latents bitwise equal to dense, receipts prove execution."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from worldfoundry_optimized_mha.plugin import prepare

from worldfoundry.base_models.diffusion_model.h3_session import build_random_h3_bundle
from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy


def _registry() -> AccelerationRegistry:
    registry = AccelerationRegistry(discover=False)
    registry.register("optimized_mha", prepare)
    return registry


def _request(pipe: NativeDiffusionPipeline, recipe: str, request_id: str) -> DiffusionRequest:
    kwargs: dict[str, Any] = {"num_inference_steps": 2, "seed": 42, "request_id": request_id, "output_type": "latent"}
    if recipe == "tiny-minimax-h3":
        return DiffusionRequest(bundle=build_random_h3_bundle(dict(pipe.components.denoiser.model.config), seed=3),
                                **kwargs)
    image = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8) if "i2v" in recipe else None
    return DiffusionRequest(prompt="a red ball", num_frames=5, height=32, width=32, guidance_scale=5.0, image=image,
                            **kwargs)


@pytest.mark.parametrize("recipe", ["tiny-wan2.1", "tiny-wan2.1-i2v", "tiny-sana-video", "tiny-minimax-h3",
                                    "tiny-wan2.2-a14b"])
def test_generate_is_bitwise_equal_to_dense(recipe: str) -> None:
    registry = _registry()
    with NativeDiffusionPipeline.from_pretrained(recipe, policy=RuntimePolicy(), registry=registry) as pipe:
        denoiser = pipe.components.denoiser
        dense = pipe.generate(_request(pipe, recipe, "dense")).latents
        state = {k: v.clone() for k, v in denoiser.model.state_dict().items()}
        denoiser.install({"optimized_mha": {}}, registry=registry)
        result = pipe.generate(_request(pipe, recipe, "fused"))
        assert torch.equal(result.latents, dense)
        assert result.receipts["installed"]["exact"] is True
        for expert, record in result.receipts["plugins"]["optimized_mha"].items():
            assert record["claimed_not_executed"] == [], expert
            assert record["counters"]["fused_qkv"] > 0
            assert record["finished"] is True
        denoiser.uninstall()
        assert all(torch.equal(state[k], v) for k, v in denoiser.model.state_dict().items())
        if recipe in ("tiny-wan2.1", "tiny-minimax-h3"):
            assert torch.equal(pipe.generate(_request(pipe, recipe, "again")).latents, dense)


def test_load_time_install_from_the_policy() -> None:
    registry = _registry()
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=RuntimePolicy(), registry=registry) as pipe:
        dense = pipe.generate(_request(pipe, "tiny-wan2.1", "d")).latents
    policy = RuntimePolicy(options={"accelerations": {"optimized_mha": {"self": {"fusion": "qkv"}}}})
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=policy, registry=registry) as pipe:
        result = pipe.generate(_request(pipe, "tiny-wan2.1", "f"))
        report = pipe.components.denoiser.runtime_optimization_report()
    assert torch.equal(result.latents, dense)
    assert report["installed"]["names"] == ["optimized_mha"]


@pytest.mark.parametrize("recipe", ["tiny-wan2.1", "tiny-minimax-h3"])
def test_fused_branch_receipts_count_every_model_call(recipe: str) -> None:
    registry = _registry()
    with NativeDiffusionPipeline.from_pretrained(recipe, policy=RuntimePolicy(), registry=registry) as pipe:
        denoiser = pipe.components.denoiser
        dense = pipe.generate(_request(pipe, recipe, "dense")).latents
        params_before = {n: p.untyped_storage().nbytes() for n, p in denoiser.model.named_parameters()}
        denoiser.install({"optimized_mha": {}}, registry=registry)
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in denoiser.model.parameters()}
        assert sum(storages.values()) == sum(params_before.values())  # zero extra weight storage
        calls: list[int] = []
        counter = denoiser.model.register_forward_pre_hook(lambda m, a: calls.append(1))
        try:
            result = pipe.generate(_request(pipe, recipe, "fused"))
        finally:
            counter.remove()
        assert torch.equal(result.latents, dense)
        plugin = result.receipts["installed"]["plugins"][0]
        assert any("diffusers_fused_branch on" in note for note in plugin["notes"])
        record = result.receipts["plugins"]["optimized_mha"]["model"]
        qkv = {k: v for k, v in record["modules"].items() if k.endswith((".to_q", ".to_k", ".to_v"))
               and "fused_qkv" in v}
        assert qkv and all(v == {"fused_qkv": len(calls)} for v in qkv.values())
        assert record["fallbacks"] == {} and record["finished"] is True
        denoiser.uninstall()
        assert {n: p.untyped_storage().nbytes() for n, p in denoiser.model.named_parameters()} == params_before
        assert torch.equal(pipe.generate(_request(pipe, recipe, "again")).latents, dense)
