"""End to end through NativeDiffusionPipeline: bitwise latents, static K/V hits = steps - 1 per branch."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import numpy as np
import pytest
import torch
from worldfoundry_wan_cross_kv_fusion.plugin import prepare

from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy

BLOCKS = 2  # the tiny Wan recipes have two blocks, so two cross-attention modules


def _registry() -> AccelerationRegistry:
    registry = AccelerationRegistry(discover=False)
    registry.register("wan_cross_kv_fusion", prepare)
    return registry


def _request(recipe: str, request_id: str, steps: int) -> DiffusionRequest:
    image = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8) if "i2v" in recipe else None
    return DiffusionRequest(prompt="a red ball", num_frames=5, height=32, width=32, num_inference_steps=steps,
                            guidance_scale=5.0, seed=42, request_id=request_id, output_type="latent", image=image)


def _check_hits(records: dict[str, Any], steps: int, groups: int) -> None:
    """Per CFG branch: one miss per module and group, then a hit on every later step of the same expert."""
    total = {"cond": 0, "uncond": 0}
    for expert, record in records.items():
        counters = record["counters"]
        for branch in total:
            misses = counters.get(f"kv_cache_miss.{branch}", 0)
            hits = counters.get(f"kv_cache_hit.{branch}", 0)
            assert misses == BLOCKS * groups, (expert, branch, counters)
            assert (hits + misses) % (BLOCKS * groups) == 0
            total[branch] += (hits + misses) // (BLOCKS * groups)
        assert record["claimed_not_executed"] == []
        assert record["notes"]["kv_cache_entries_dropped"] == 2 * BLOCKS * groups
    assert total == {"cond": steps, "uncond": steps}


@pytest.mark.parametrize(("recipe", "options", "groups", "steps"), [
    ("tiny-wan2.1", {"min_tokens": 0}, 1, 3),
    ("tiny-wan2.1-i2v", {"min_tokens": 0, "include_image": True}, 2, 2),
    ("tiny-wan2.2-a14b", {"min_tokens": 0}, 1, 3),
])
def test_generate_is_bitwise_and_reuses_static_kv(recipe: str, options: dict[str, Any], groups: int,
                                                  steps: int) -> None:
    registry = _registry()
    with NativeDiffusionPipeline.from_pretrained(recipe, policy=RuntimePolicy(), registry=registry) as pipe:
        denoiser = pipe.components.denoiser
        dense = pipe.generate(_request(recipe, "dense", steps)).latents
        denoiser.install({"wan_cross_kv_fusion": options}, registry=registry)
        result = pipe.generate(_request(recipe, "cached", steps))
        assert torch.equal(result.latents, dense)
        assert result.receipts["installed"]["exact"] is True
        records = result.receipts["plugins"]["wan_cross_kv_fusion"]
        if recipe == "tiny-wan2.1":
            record = records["model"]
            assert record["counters"]["kv_cache_hit.cond"] == (steps - 1) * BLOCKS
            assert record["counters"]["kv_cache_hit.uncond"] == (steps - 1) * BLOCKS
        _check_hits(records, steps, groups)
        handles = denoiser.session.handles("wan_cross_kv_fusion")
        assert all(h.cache.entries() == 0 for h in handles.values())  # dropped at request end
        denoiser.uninstall()


def test_default_min_tokens_bypasses_the_short_tiny_prompt() -> None:
    registry = _registry()
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=RuntimePolicy(), registry=registry,
                                                 accelerations={"wan_cross_kv_fusion": {}}) as pipe:
        result = pipe.generate(_request("tiny-wan2.1", "short", 2))
        pipe.components.denoiser.uninstall()
        dense = pipe.generate(_request("tiny-wan2.1", "dense", 2)).latents
    record = result.receipts["plugins"]["wan_cross_kv_fusion"]["model"]
    assert torch.equal(result.latents, dense)
    assert record["counters"]["dense_bypass"] == 2 * 2 * BLOCKS  # 16 text tokens < 256
    assert record["module_fallbacks"]["blocks.0.attn2.to_k"] == {"below_min_tokens": 4}


def test_both_plugins_together_end_to_end() -> None:
    try:
        importlib.metadata.distribution("worldfoundry-optimized-mha")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("optimized_mha is not installed")
    registry = AccelerationRegistry(allowlist=["optimized_mha", "wan_cross_kv_fusion"])
    spec = {"optimized_mha": {"self": {"fusion": "qkv"}}, "wan_cross_kv_fusion": {"min_tokens": 0}}
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=RuntimePolicy(), registry=registry) as pipe:
        dense = pipe.generate(_request("tiny-wan2.1", "dense", 3)).latents
        pipe.components.denoiser.install(spec, registry=registry)
        result = pipe.generate(_request("tiny-wan2.1", "both", 3))
    assert torch.equal(result.latents, dense)
    assert result.receipts["installed"]["exact"] is True
    _check_hits(result.receipts["plugins"]["wan_cross_kv_fusion"], 3, 1)
    assert result.receipts["plugins"]["optimized_mha"]["model"]["claimed_not_executed"] == []
