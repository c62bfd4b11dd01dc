"""End to end through ``NativeDiffusionPipeline`` (tiny-wan2.1, CPU): the receipts show one dense fallback per
selected module and denoiser call with its reason (the fused GELU producers are installed but, on the CPU, the
original FFN forward runs), the latents equal the dense pipeline's, and the loaded model is an inference view
until the pipeline closes."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import InferenceViewError

REQUEST = dict(prompt="a red ball", num_frames=5, height=32, width=32, num_inference_steps=2, guidance_scale=5.0,
               seed=42, output_type="latent")
FFN = ["blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2"]


def test_tiny_wan_pipeline_receipts_and_dense_equal_latents():
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=RuntimePolicy()) as pipe:
        dense = pipe.generate(DiffusionRequest(request_id="dense", **REQUEST)).latents
    policy = RuntimePolicy(options={"accelerations": {"selective_fp8": {"min_tokens": 1}}})
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=policy) as pipe:
        result = pipe.generate(DiffusionRequest(request_id="r1", **REQUEST))
        record = result.receipts["plugins"]["selective_fp8"]["model"]
        calls = 2 * 2  # 2 steps x (cond + uncond)
        assert record["fallbacks"] == {"cpu device": calls * len(FFN)}
        assert record["module_fallbacks"] == {p: {"cpu device": calls} for p in FFN}
        assert record["modules"] == {} and record["skipped"] == {}  # the CPU: no FP8, so no fused FFN either
        assert sorted(record["claimed_not_executed"]) == sorted([*FFN, "blocks.0.ffn", "blocks.1.ffn"])
        notes = result.receipts["installed"]["plugins"][0]["notes"]
        assert any(n.startswith("2 FFN(s) run GELU + the down projection's activation quantization") for n in notes)
        report = pipe.components.denoiser.runtime_optimization_report()
        fused = report["plugins"]["selective_fp8"]["model"]["selective_fp8"]["fused_producer"]
        assert fused["ffns"] == ["blocks.0.ffn", "blocks.1.ffn"] and fused["not_fused"] == {}
        assert record["notes"]["activation_clipped_elements"] == 0
        assert result.receipts["installed"]["plugins"][0]["exact"] is False
        assert torch.equal(result.latents, dense)
        with pytest.raises(InferenceViewError, match="uninstall selective_fp8 first"):
            pipe.components.denoiser.model.state_dict()
