"""``per_expert`` overrides: each expert of a routed denoiser gets its own options; receipts say which."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.bench.candidates import parse_candidates
from worldfoundry.core.acceleration.registry import diffusion_acceleration_registry
from worldfoundry.core.acceleration.spec import expert_options
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import AccelerationOptionsError, CandidateSchemaError


@pytest.fixture(scope="module")
def routed():
    pipe = NativeDiffusionPipeline.from_pretrained("tiny-wan2.2-a14b", policy=RuntimePolicy(device="cpu",
                                                                                             dtype="fp32"))
    yield pipe
    pipe.close()


def _generate(pipe, rid: str):
    return pipe.generate(DiffusionRequest(prompt="a red square", num_inference_steps=8, seed=42, request_id=rid,
                                          output_type="latent", progress=False))


def test_expert_options_merges_over_the_shared_ones() -> None:
    opts = {"threshold": 0.0, "warmup_steps": 1, "per_expert": {"low": {"threshold": 0.3}}}
    assert expert_options(opts, "low") == {"threshold": 0.3, "warmup_steps": 1}
    assert expert_options(opts, "high") == {"threshold": 0.0, "warmup_steps": 1}


def test_each_expert_runs_its_own_options_and_the_receipt_records_them(routed) -> None:
    den = routed.components.denoiser
    dense = _generate(routed, "dense")
    session = den.install({"easycache": {"threshold": 0.0, "warmup_steps": 1,
                                         "per_expert": {"low": {"threshold": 0.5}}}})
    try:
        record = session.receipt.to_json()["plugins"][0]
        assert record["per_expert_options"]["high"]["threshold"] == 0.0
        assert record["per_expert_options"]["low"]["threshold"] == 0.5
        out = _generate(routed, "per-expert")
        plugins = out.receipts["plugins"]["easycache"]
        assert plugins["high"]["skipped"] == {}  # threshold 0 on the high-noise expert: nothing skipped
        assert plugins["low"]["skipped"].get("steps", 0) > 0
        assert not torch.equal(out.latents, dense.latents)
    finally:
        session.uninstall()
    assert torch.equal(_generate(routed, "after").latents, dense.latents)
    same = den.install({"easycache": {"threshold": 0.0}})
    try:
        assert "per_expert_options" not in same.receipt.to_json()["plugins"][0]
    finally:
        same.uninstall()


@pytest.mark.parametrize(("per_expert", "match"), [
    ({"mid": {"threshold": 0.1}}, r"spec.easycache.per_expert.mid: no such expert; the model's experts are"),
    ({}, r"spec.easycache.per_expert: expected a non-empty mapping"),
    ({"low": 0.1}, r"spec.easycache.per_expert.low: expected an options mapping"),
    ({"low": {"per_expert": {}}}, r"spec.easycache.per_expert.low: expected an options mapping"),
])
def test_bad_overrides_are_refused_before_anything_changes(routed, per_expert, match) -> None:
    den = routed.components.denoiser
    with pytest.raises(AccelerationOptionsError, match=match):
        den.install({"easycache": {"threshold": 0.1, "per_expert": per_expert}})
    assert den.session is None


def test_an_override_the_plugin_refuses_names_its_expert(routed) -> None:
    with pytest.raises(AccelerationOptionsError, match="threshold"):
        routed.components.denoiser.install({"easycache": {"per_expert": {"low": {"threshold": -1.0}}}})
    assert routed.components.denoiser.session is None


def test_candidate_files_check_each_experts_options() -> None:
    registry = diffusion_acceleration_registry()

    def cfile(options):
        return {"model": "tiny-wan2.2-a14b", "candidates": [{"name": "c", "accelerations": {"easycache": options}}]}

    parse_candidates(cfile({"threshold": 0.0, "per_expert": {"low": {"threshold": 0.2}}}), registry=registry)
    with pytest.raises(CandidateSchemaError, match=r"candidates\[0\].accelerations.easycache.per_expert.low"):
        parse_candidates(cfile({"per_expert": {"low": {"threshold": "high"}}}), registry=registry)
    with pytest.raises(CandidateSchemaError, match="expected a non-empty object expert name -> options object"):
        parse_candidates(cfile({"per_expert": ["low"]}), registry=registry)
