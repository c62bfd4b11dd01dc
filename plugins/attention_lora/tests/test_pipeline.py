"""End to end through ``NativeDiffusionPipeline`` with ``tiny-minimax-h3`` and ``tiny-wan2.1``."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import save_file
from worldfoundry_attention_lora import apply_dit_attention_lora

from worldfoundry.base_models.diffusion_model.h3_session import build_random_h3_bundle
from worldfoundry.base_models.diffusion_model.pipeline import (
    DiffusionRequest,
    NativeDiffusionPipeline,
)

RANK = 4


def _shared_down(record: dict) -> dict[str, int]:
    """The shared-down counters of one request's attention_lora record."""
    prefix = "shared_down:"
    return {k.removeprefix(prefix): v for k, v in record["counters"].items() if k.startswith(prefix)}


def test_h3_pipeline_with_the_context_manager(tools) -> None:
    with NativeDiffusionPipeline.from_pretrained("tiny-minimax-h3") as pipe:
        model = pipe.components.denoiser.model
        bundle = build_random_h3_bundle(dict(model.config), seed=3)
        adapter = tools.make_h3_adapter(model, RANK, prefix="diffusion_model.", infix=".default")

        def generate(request_id: str):
            return pipe.generate(DiffusionRequest(bundle=bundle, seed=1, request_id=request_id, num_inference_steps=3))

        base = generate("base")
        with apply_dit_attention_lora(pipe, adapter.state, rank=RANK, scale=-1.0) as session:
            adapted = generate("adapted")
            again = generate("adapted-again")
        with apply_dit_attention_lora(pipe, adapter.state, rank=RANK, scale=0.0):
            zero = generate("zero")
        after = generate("after")
        assert pipe.components.denoiser.session is None
    assert not torch.equal(adapted.latents, base.latents)
    assert torch.equal(adapted.latents, again.latents)
    assert torch.equal(zero.latents, base.latents) and torch.equal(zero.audio_latents, base.audio_latents)
    assert torch.equal(after.latents, base.latents) and torch.equal(after.audio_latents, base.audio_latents)
    record = adapted.receipts["plugins"]["attention_lora"]["model"]
    identity = record["notes"]["attention_adapter"]
    assert identity["sha256"] == session.receipt.plugins[0].options["sha256"]
    assert {identity[k] for k in ("scope", "precision")} == {"dit_only", "fp32"}
    assert identity["rank"] == RANK and identity["scale"] == -1.0
    assert set(record["modules"]) == set(adapter.expected)
    calls = {kinds["fp32_adapter"] for kinds in record["modules"].values()}
    assert len(calls) == 1 and (n_calls := calls.pop()) >= 3, "every adapted projection runs once per model call"
    # per block and model call: to_q computes the Q/K/V down step, to_k and to_v take it over
    blocks = len(adapter.expected) // 4
    assert _shared_down(record) == {"group_computed": blocks * n_calls, "handed_over": 2 * blocks * n_calls}
    assert adapted.receipts["installed"]["plugins"][0]["options"]["scope"] == "dit_only"
    assert "attention_lora" not in base.receipts["plugins"] and "attention_lora" not in after.receipts["plugins"]


def test_wan_pipeline_with_the_spec(tools, tmp_path) -> None:
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1") as pipe:
        adapter = tools.make_wan_adapter(pipe.components.denoiser.model, RANK, prefix="transformer.", magnitude=0.5)
        base = pipe.generate(DiffusionRequest(prompt="a red ball", seed=2, request_id="base", num_inference_steps=2,
                                              guidance_scale=5.0))
    path = tmp_path / "wan-attention-adapter.safetensors"
    save_file(adapter.state, str(path))
    spec = {"attention_lora": {"path": str(path), "rank": RANK, "scale": -1.0}}
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", accelerations=spec) as pipe:
        result = pipe.generate(DiffusionRequest(prompt="a red ball", seed=2, request_id="lora", num_inference_steps=2,
                                                guidance_scale=5.0))
        model = pipe.components.denoiser.model
        pipe.components.denoiser.uninstall()
        restored = pipe.generate(DiffusionRequest(prompt="a red ball", seed=2, request_id="plain",
                                                  num_inference_steps=2, guidance_scale=5.0))
        assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == []
    assert not torch.equal(result.latents, base.latents)
    assert torch.equal(restored.latents, base.latents)
    record = result.receipts["plugins"]["attention_lora"]["model"]
    assert record["notes"]["attention_adapter"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    # two steps × two CFG branches
    assert all(kinds == {"fp32_adapter": 4} for kinds in record["modules"].values())
    # per block and forward: attn1 Q/K/V and attn2 K/V each one group step, three hand-overs in all
    blocks = len(adapter.expected) // 8
    assert _shared_down(record) == {"group_computed": 2 * blocks * 4, "handed_over": 3 * blocks * 4}
    assert set(record["modules"]) == set(adapter.expected)
    installed = result.receipts["installed"]["plugins"][0]
    assert installed["options"]["path"] == str(path) and installed["options"]["precision"] == "fp32"


def test_h3_under_resident_blocks_matches_resident_model(tools, tmp_path) -> None:
    """resident_blocks swaps block weights on the compute path; the adapter runs inside the projections."""
    from worldfoundry.core.acceleration.registry import diffusion_acceleration_registry

    if "resident_blocks" not in diffusion_acceleration_registry().names():
        pytest.skip("resident_blocks is not installed")
    with NativeDiffusionPipeline.from_pretrained("tiny-minimax-h3") as pipe:
        config = dict(pipe.components.denoiser.model.config)
        adapter = tools.make_h3_adapter(pipe.components.denoiser.model, RANK)
    path = tmp_path / "h3-adapter.safetensors"
    save_file(adapter.state, str(path))
    bundle = build_random_h3_bundle(config, seed=5)
    lora = {"attention_lora": {"path": str(path), "rank": RANK, "scale": -1.0}}
    offload = {"resident_blocks": {"offload_resident_blocks": 0, "cpu_offload_block_contiguous": False}}
    results = {}
    for name, spec in (("resident", lora), ("offloaded", {**lora, **offload})):
        with NativeDiffusionPipeline.from_pretrained("tiny-minimax-h3", accelerations=spec) as pipe:
            results[name] = pipe.generate(DiffusionRequest(bundle=bundle, seed=1, request_id=name,
                                                           num_inference_steps=2))
    assert torch.equal(results["resident"].latents, results["offloaded"].latents)
    record = results["offloaded"].receipts["plugins"]["attention_lora"]["model"]
    assert set(record["modules"]) == set(adapter.expected)
    resident = results["resident"].receipts["plugins"]["attention_lora"]["model"]
    assert _shared_down(record) == _shared_down(resident) and _shared_down(record)["handed_over"] > 0
    offloaded = results["offloaded"].receipts["plugins"]["resident_blocks"]["model"]
    assert offloaded["counters"]["streamed"] > 0, "the blocks really ran from the slots"
