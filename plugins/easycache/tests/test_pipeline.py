"""End to end through ``NativeDiffusionPipeline`` with the offline tiny recipes (random seeded weights)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from worldfoundry.base_models.diffusion_model.pipeline import (
    DiffusionRequest,
    NativeDiffusionPipeline,
)
from worldfoundry.core.model_loading.policy import RuntimePolicy

POLICY = RuntimePolicy(device="cpu", dtype=torch.float32)
HUGE = 1e30


def _request(request_id: str, steps: int = 6) -> DiffusionRequest:
    return DiffusionRequest(prompt="a red ball", num_frames=5, height=32, width=32, num_inference_steps=steps,
                            guidance_scale=5.0, seed=42, request_id=request_id, output_type="latent")


def _expected(length: int, warmup: int, final: int) -> str:
    return "".join("C" if i < max(warmup, 2) or i >= length - final else "S" for i in range(length))


@pytest.fixture(scope="module")
def wan21():
    pipe = NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=POLICY)
    yield pipe
    pipe.close()


@pytest.fixture(scope="module")
def wan22():
    pipe = NativeDiffusionPipeline.from_pretrained("tiny-wan2.2-a14b", policy=POLICY)
    yield pipe
    pipe.close()


def test_load_time_spec_installs_through_the_policy(registry):
    policy = RuntimePolicy(device="cpu", dtype=torch.float32,
                           options={"accelerations": {"easycache": {"threshold": 0.0}}})
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=policy, registry=registry) as pipe:
        result = pipe.generate(_request("r1", steps=3))
        record = result.receipts["plugins"]["easycache"]
        (expert_record,) = record.values()
        assert expert_record["modules"] == {"<root>": {"computed": 6}}
        assert result.receipts["installed"]["names"] == ["easycache"]


def test_wan21_threshold_zero_is_dense_and_skips_are_counted(wan21, registry):
    denoiser = wan21.components.denoiser
    dense = wan21.generate(_request("dense")).latents

    denoiser.install({"easycache": {"threshold": 0.0}}, POLICY, registry=registry)
    try:
        assert torch.equal(wan21.generate(_request("th0")).latents, dense)
    finally:
        denoiser.uninstall()

    denoiser.install({"easycache": {"threshold": HUGE, "warmup_steps": 2}}, POLICY, registry=registry)
    try:
        first = wan21.generate(_request("skip-1"))
        second = wan21.generate(_request("skip-2"))
    finally:
        denoiser.uninstall()
    (record,) = first.receipts["plugins"]["easycache"].values()
    summary = record["notes"]["easycache"]
    assert summary["branches"]["cond"]["pattern"] == "CCSSSC"
    assert summary["branches"]["uncond"]["pattern"] == "CCSSSC"
    assert record["skipped"] == {"steps": 6}
    assert record["claimed_not_executed"] == []
    assert not torch.equal(first.latents, dense)
    assert torch.equal(first.latents, second.latents)  # a second identical request: bitwise the same
    assert torch.equal(wan21.generate(_request("after")).latents, dense)  # exact restore


def test_wan22_experts_gate_within_their_phases(wan22, registry):
    denoiser = wan22.components.denoiser
    assert list(denoiser.experts) == ["high", "low"]
    dense = wan22.generate(_request("dense", steps=12)).latents
    denoiser.install({"easycache": {"threshold": 0.0}}, POLICY, registry=registry)
    try:
        assert torch.equal(wan22.generate(_request("th0", steps=12)).latents, dense)
    finally:
        denoiser.uninstall()

    denoiser.install({"easycache": {"threshold": HUGE, "warmup_steps": 2, "final_dense_steps": 1}}, POLICY,
                     registry=registry)
    try:
        result = wan22.generate(_request("skip", steps=12))
    finally:
        denoiser.uninstall()
    records = result.receipts["plugins"]["easycache"]
    phases = {e: records[e]["notes"]["easycache"]["phase"] for e in ("high", "low")}
    assert phases["high"]["start"] == 0 and phases["low"]["start"] == phases["high"]["length"]
    assert phases["high"]["length"] + phases["low"]["length"] == 12
    skipped = 0
    for expert in ("high", "low"):
        summary = records[expert]["notes"]["easycache"]
        assert summary["outcome"] == "completed"
        for branch in ("cond", "uncond"):
            assert summary["branches"][branch]["pattern"] == _expected(phases[expert]["length"], 2, 1)
        skipped += records[expert]["skipped"].get("steps", 0)
    assert skipped > 0
    assert result.provenance["schedule"]["phases"][1]["expert"] == "low"


def test_failure_mid_request_releases_and_the_next_request_is_clean(wan21, registry):
    denoiser = wan21.components.denoiser
    denoiser.install({"easycache": {"threshold": HUGE, "warmup_steps": 2}}, POLICY, registry=registry)
    model = denoiser.model
    handle = denoiser.session.handles("easycache")["model"]
    try:
        clean = wan21.generate(_request("clean"))
        calls = {"n": 0}

        def fail_on_fifth(module, args):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("device lost")

        hook = model.blocks[0].register_forward_pre_hook(fail_on_fifth)
        try:
            with pytest.raises(RuntimeError, match="device lost"):
                wan21.generate(_request("broken"))
        finally:
            hook.remove()
        assert handle.active_requests() == () and handle.held_tensors() == []
        assert denoiser.guard.active_request_ids() == ()
        again = wan21.generate(_request("again"))
        assert torch.equal(again.latents, clean.latents)
        report = denoiser.runtime_optimization_report()["plugins"]["easycache"]["model"]["requests"]
        assert report["broken"]["notes"]["easycache"]["outcome"] == "failed"
    finally:
        denoiser.uninstall()


def test_sana_video_threshold_zero_is_dense_and_skips(registry):
    with NativeDiffusionPipeline.from_pretrained("tiny-sana-video", policy=POLICY) as pipe:
        request = DiffusionRequest(prompt="a red ball", num_inference_steps=6, guidance_scale=5.0, seed=42,
                                   request_id="dense", output_type="latent")
        dense = pipe.generate(request).latents
        denoiser = pipe.components.denoiser
        denoiser.install({"easycache": {"threshold": 0.0}}, POLICY, registry=registry)
        try:
            assert torch.equal(pipe.generate(replace(request, request_id="th0")).latents, dense)
        finally:
            denoiser.uninstall()
        denoiser.install({"easycache": {"threshold": HUGE, "warmup_steps": 2}}, POLICY, registry=registry)
        try:
            result = pipe.generate(replace(request, request_id="skip"))
        finally:
            denoiser.uninstall()
        (record,) = result.receipts["plugins"]["easycache"].values()
        assert record["notes"]["easycache"]["branches"]["cond"]["pattern"] == "CCSSSC"
        assert record["skipped"] == {"steps": 6}
