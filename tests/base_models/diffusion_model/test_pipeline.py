"""End-to-end tests of the native pipeline on every tiny recipe (CPU, offline)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from worldfoundry.base_models.diffusion_model.h3_session import build_random_h3_bundle
from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.core.acceleration.context import current_request
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import InvalidRequestError, PipelineClosedError, UnknownRecipeError

TINY = ["tiny-wan2.1", "tiny-wan2.1-i2v", "tiny-wan2.2-a14b", "tiny-sana-video", "tiny-minimax-h3"]


def _extra(pipe: NativeDiffusionPipeline, name: str) -> dict:
    if name.endswith("i2v"):
        return {"image": (np.random.RandomState(0).rand(32, 32, 3) * 255).astype(np.uint8)}
    if "h3" in name:
        return {"bundle": build_random_h3_bundle(dict(pipe.components.denoiser.model.config), seed=3)}
    return {}


@pytest.mark.parametrize("name", TINY)
def test_tiny_recipe_end_to_end_is_deterministic(name: str) -> None:
    with NativeDiffusionPipeline.from_pretrained(name, policy=RuntimePolicy()) as pipe:
        extra = _extra(pipe, name)
        output = "latent" if "h3" in name else "np"
        a = pipe.generate(DiffusionRequest(prompt="a red square moving left", seed=7, output_type=output, **extra))
        b = pipe.generate(DiffusionRequest(prompt="a red square moving left", seed=7, output_type=output, **extra))
        if "h3" in name:  # the bundle carries the initial noise: another bundle, another result
            extra = {"bundle": build_random_h3_bundle(dict(pipe.components.denoiser.model.config), seed=4)}
        c = pipe.generate(DiffusionRequest(prompt="a red square moving left", seed=8, output_type=output, **extra))
    assert torch.isfinite(a.latents).all()
    assert torch.equal(a.latents, b.latents), "same seed must give bitwise the same latents"
    assert not torch.equal(a.latents, c.latents), "a different seed must change the latents"
    assert a.request_id != b.request_id
    assert a.provenance["random_weights"] is True
    if output == "np":
        assert a.frames is not None and a.frames.dtype == np.uint8 and a.frames.shape == (5, 32, 32, 3)
        assert np.array_equal(a.frames, b.frames)
    else:
        assert a.audio_latents is not None and torch.isfinite(a.audio_latents).all()
    assert len(a.timings["steps_s"]) == 4 or name == "tiny-wan2.2-a14b"
    # each step's host part (until its work was issued) is recorded beside it, never longer than the step
    assert len(a.timings["host_steps_s"]) == len(a.timings["steps_s"])
    assert all(0 <= h <= t for h, t in zip(a.timings["host_steps_s"], a.timings["steps_s"]))


def test_a_steps_host_part_ends_before_the_scheduler(monkeypatch) -> None:
    """A scheduler step that waits (diffusers' UniPC synchronizes on the device) counts in the step's time, not in
    its host part: the host part measures issuing the model's work only."""
    import time

    from worldfoundry.base_models.diffusion_model import runner as runner_module

    real = runner_module.fresh_scheduler

    def slow_scheduler(base, shift):  # noqa: ANN001, ANN202 - the runner's own signature
        scheduler = real(base, shift)
        step = scheduler.step

        def waiting_step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            time.sleep(0.05)
            return step(*args, **kwargs)

        scheduler.step = waiting_step
        return scheduler

    monkeypatch.setattr(runner_module, "fresh_scheduler", slow_scheduler)
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1") as pipe:
        out = pipe.generate(DiffusionRequest(prompt="a ball", seed=1, output_type="latent"))
    assert all(t >= 0.05 for t in out.timings["steps_s"])
    assert all(t - h >= 0.05 for h, t in zip(out.timings["host_steps_s"], out.timings["steps_s"]))


def test_same_pipeline_two_instances_same_weights() -> None:
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1") as p1, \
            NativeDiffusionPipeline.from_pretrained("tiny-wan2.1") as p2:
        r1 = p1.generate(DiffusionRequest(prompt="a ball", seed=1))
        r2 = p2.generate(DiffusionRequest(prompt="a ball", seed=1))
    assert torch.equal(r1.latents, r2.latents), "random seeded weights must be reproducible across loads"


def test_dual_expert_switch_at_boundary() -> None:
    calls: list[tuple[str, int, str]] = []
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.2-a14b") as pipe:
        den = pipe.components.denoiser
        assert list(den.experts) == ["high", "low"]
        for label, module in den.experts.items():
            module.register_forward_pre_hook(
                lambda m, a, label=label: calls.append((label, current_request().step_index, current_request().branch))
            )
        result = pipe.generate(DiffusionRequest(prompt="a blue ring", seed=3, num_inference_steps=6))
    sched = result.provenance["schedule"]
    boundary = 0.875 * 1000
    expected = ["high" if t >= boundary else "low" for t in sched["timesteps"]]
    assert sched["experts"] == expected and "high" in expected and "low" in expected
    for step, expert in enumerate(expected):
        assert [c[0] for c in calls if c[1] == step] == [expert, expert], f"step {step}"
        assert [c[2] for c in calls if c[1] == step] == ["cond", "uncond"]


def test_guidance_one_runs_cond_branch_only() -> None:
    branches = []
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1") as pipe:
        pipe.components.denoiser.model.register_forward_pre_hook(lambda m, a: branches.append(current_request().branch))
        pipe.generate(DiffusionRequest(prompt="x", guidance_scale=1.0, num_inference_steps=3))
    assert branches == ["cond"] * 3


def test_guard_released_after_exception_inside_a_step() -> None:
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1") as pipe:
        den = pipe.components.denoiser
        state = {"n": 0}

        def boom(module, args):
            state["n"] += 1
            if state["n"] == 3:
                raise RuntimeError("injected failure")

        handle = den.model.blocks[0].register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="injected failure"):
            pipe.generate(DiffusionRequest(prompt="x", request_id="fails"))
        assert den.guard.active_request_ids() == ()
        assert den.guard.active_forwards == 0
        handle.remove()
        ok = pipe.generate(DiffusionRequest(prompt="x", request_id="fails"))  # the id is free again
        assert torch.isfinite(ok.latents).all()


def test_guard_released_after_keyboard_interrupt() -> None:
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1") as pipe:
        den = pipe.components.denoiser

        def interrupt(module, args):
            raise KeyboardInterrupt

        handle = den.model.blocks[1].register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            pipe.generate(DiffusionRequest(prompt="x"))
        handle.remove()
        assert den.guard.active_request_ids() == ()
        assert den.guard.active_forwards == 0


def test_close_releases_weights() -> None:
    pipe = NativeDiffusionPipeline.from_pretrained("tiny-wan2.1")
    refs = [weakref.ref(pipe.components.denoiser.model), weakref.ref(pipe.components.text_encoder),
            weakref.ref(pipe.components.codec.module)]
    param_ref = weakref.ref(next(pipe.components.denoiser.model.parameters()))
    pipe.generate(DiffusionRequest(prompt="x", num_inference_steps=1))
    pipe.close()
    pipe.close()  # idempotent
    gc.collect()
    assert all(r() is None for r in refs), "a closed pipeline must hold no model"
    assert param_ref() is None
    with pytest.raises(PipelineClosedError):
        pipe.generate(DiffusionRequest(prompt="x"))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_frames": 6}, "4·k \\+ 1"),
        ({"height": 36}, "divisible by 16"),
        ({"width": 20}, "divisible by 16"),
    ],
)
def test_request_validation_errors(changes: dict, match: str) -> None:
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1") as pipe:
        with pytest.raises(InvalidRequestError, match=match):
            pipe.generate(DiffusionRequest(prompt="x", **changes))
        assert pipe.components.denoiser.guard.active_request_ids() == ()


@pytest.mark.parametrize("kwargs", [{"num_inference_steps": -1}, {"num_inference_steps": 0}, {"seed": -3},
                                    {"output_type": "gif"}, {"output_type": "mp4"}, {"guidance_scale": float("nan")}])
def test_request_field_errors(kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError):
        DiffusionRequest(prompt="x", **kwargs)


def test_unknown_recipe_lists_known() -> None:
    with pytest.raises(UnknownRecipeError) as info:
        NativeDiffusionPipeline.from_pretrained("tiny-wan9")
    assert "tiny-wan2.1" in str(info.value)


def test_i2v_requires_image_and_h3_requires_bundle() -> None:
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1-i2v") as pipe:
        with pytest.raises(InvalidRequestError, match="image"):
            pipe.generate(DiffusionRequest(prompt="x"))
    with NativeDiffusionPipeline.from_pretrained("tiny-minimax-h3") as pipe:
        with pytest.raises(InvalidRequestError, match="bundle"):
            pipe.generate(DiffusionRequest(prompt="x"))
        with pytest.raises(InvalidRequestError, match="no codec"):
            pipe.generate(DiffusionRequest(prompt="x", output_type="np", bundle="unused"))


def test_mp4_output(tmp_path) -> None:
    from worldfoundry.base_models.diffusion_model.video_io import mp4_unavailable_reason, read_mp4

    if mp4_unavailable_reason() is not None:  # imageio-ffmpeg is a declared dependency; tests/.../test_video_io.py
        pytest.skip(f"no MP4 support in this environment: {mp4_unavailable_reason()}")  # covers its absence

    out = tmp_path / "v.mp4"
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1") as pipe:
        result = pipe.generate(DiffusionRequest(prompt="x", num_frames=9, num_inference_steps=2, output_type="mp4",
                                                output_path=str(out)))
    assert result.video_path == str(out)
    frames = read_mp4(out)
    assert frames.shape == (9, 32, 32, 3)
    # lossy codec: close to the decoded frames, not equal
    assert np.abs(frames.astype(np.int16) - result.frames.astype(np.int16)).mean() < 40


def test_the_between_steps_hook_runs_before_every_step_outside_the_loop_time() -> None:
    import time

    from worldfoundry.base_models.diffusion_model.runner import BETWEEN_STEPS

    calls: list[float] = []

    def hold() -> None:
        calls.append(time.perf_counter())
        time.sleep(0.05)

    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=RuntimePolicy()) as pipe:
        request = DiffusionRequest(prompt="a red square moving left", seed=7, output_type="latent")
        plain = pipe.generate(request)
        token = BETWEEN_STEPS.set(hold)
        try:
            held = pipe.generate(request)
        finally:
            BETWEEN_STEPS.reset(token)
        after = pipe.generate(request)
    assert len(calls) == len(held.timings["steps_s"]) == 4
    assert held.timings["between_steps_s"] >= 4 * 0.05
    assert held.timings["denoise_s"] < held.timings["between_steps_s"] + sum(held.timings["steps_s"])
    assert max(held.timings["steps_s"]) < 0.05 + min(plain.timings["steps_s"]) * 10  # steps exclude the holds
    assert torch.equal(held.latents, plain.latents)  # waiting between steps changes nothing computed
    assert "between_steps_s" not in plain.timings and "between_steps_s" not in after.timings
