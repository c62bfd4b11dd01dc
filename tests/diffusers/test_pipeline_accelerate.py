"""Accelerations on diffusers' own pipelines: bitwise to vanilla, request per call, nothing left behind."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from conftest import EXACT_SPECS, applicable, carried, same_state, spec_for, state
from pipelines import STEPS, wan22, wan_t2v

import worldfoundry
from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.guard import get_request_guard
from worldfoundry.errors import InferenceViewError, ModelBusyError, RequestError, SessionAlreadyInstalledError
from worldfoundry.integrations.diffusers_pipeline import PipelineAcceleration


@pytest.mark.parametrize("plugin", sorted(EXACT_SPECS))
def test_exact_plugin_is_bitwise_on_the_pipeline_and_uninstall_leaves_nothing(tiny, plugin):
    if not applicable(plugin, tiny.kind):
        pytest.skip(f"{plugin} is for Wan models")
    vanilla = tiny.run()
    pipe_class = type(tiny.pipe)
    before = {name: (carried(m), state(m)) for name, m in zip(tiny.dits, tiny.transformers())}
    accel = worldfoundry.accelerate(tiny.pipe, spec_for(plugin, tiny.kind))
    assert isinstance(accel, PipelineAcceleration) and type(tiny.pipe).__name__ == pipe_class.__name__
    accelerated = tiny.run()
    receipt = accel.last_call
    assert receipt.outcome == "completed" and plugin in receipt.plugins
    assert torch.equal(accelerated, vanilla)
    accel.uninstall()
    assert type(tiny.pipe) is pipe_class and "_worldfoundry_accelerations" not in tiny.pipe.__dict__
    assert accel.session.restore_differences == []
    for name, module in zip(tiny.dits, tiny.transformers()):
        assert carried(module) == before[name][0], name
        assert same_state(state(module), before[name][1])
        assert get_request_guard(module) is None
    assert torch.equal(tiny.run(), vanilla)


def test_easycache_threshold_zero_computes_every_step_of_every_branch():
    tp = wan_t2v()
    vanilla = tp.run()
    accel = install_diffusion_accelerations(tp.pipe, {"easycache": {"threshold": 0.0}})
    assert torch.equal(tp.run(), vanilla)
    counters = accel.last_call.plugins["easycache"]["model"]["counters"]
    assert counters == {"computed": 2 * STEPS}
    summary = accel.last_call.plugins["easycache"]["model"]["notes"]["easycache"]
    assert summary["outcome"] == "completed"
    assert {b: r["pattern"] for b, r in summary["branches"].items()} == {"cond": "C" * STEPS, "uncond": "C" * STEPS}
    accel.uninstall()


def test_easycache_skips_steps_when_the_threshold_allows():
    tp = wan_t2v(steps=8)
    vanilla = tp.run()
    accel = worldfoundry.accelerate(tp.pipe, {"easycache": {"threshold": 10.0, "warmup_steps": 1,
                                                             "final_dense_steps": 1}})
    out = tp.run()
    counters = accel.last_call.plugins["easycache"]["model"]["counters"]
    assert counters.get("skipped.steps", 0) > 0 or any(k.startswith("skipped") for k in counters), counters
    assert torch.isfinite(out).all() and not torch.equal(out, vanilla)
    accel.uninstall()
    assert torch.equal(tp.run(), vanilla)


def test_static_text_kv_hits_steps_minus_one_per_branch():
    tp = wan_t2v()
    vanilla = tp.run()
    accel = worldfoundry.accelerate(tp.pipe, {"wan_cross_kv_fusion": {"min_tokens": 0}})
    assert torch.equal(tp.run(), vanilla)
    counters = accel.last_call.plugins["wan_cross_kv_fusion"]["model"]["counters"]
    layers = len(tp.pipe.transformer.blocks)
    assert counters["kv_cache_hit.cond"] == (STEPS - 1) * layers
    assert counters["kv_cache_hit.uncond"] == (STEPS - 1) * layers
    assert "kv_cache_unscoped" not in counters
    accel.uninstall()


def test_wan22_both_experts_share_one_guard_and_the_schedule_follows_the_boundary():
    tp = wan22()
    vanilla = tp.run()
    high, low = tp.transformers()
    accel = worldfoundry.accelerate(tp.pipe, {"easycache": {"threshold": 0.0},
                                              "wan_cross_kv_fusion": {"min_tokens": 0}})
    assert set(accel.models) == {"transformer", "transformer_2"}
    assert get_request_guard(high) is get_request_guard(low) is not None
    assert torch.equal(tp.run(), vanilla)
    receipt = accel.last_call
    boundary = 0.875 * tp.pipe.scheduler.config.num_train_timesteps
    timesteps = tp.pipe.scheduler.timesteps
    expected = ["transformer" if bool(t >= boundary) else "transformer_2" for t in timesteps]
    assert receipt.schedule["experts"] == expected and len(set(expected)) == 2
    phases = {p["expert"]: p["length"] for p in receipt.schedule["phases"]}
    assert receipt.forwards == {e: 2 * n for e, n in phases.items()}
    for expert, n in phases.items():
        kv = receipt.plugins["wan_cross_kv_fusion"][expert]["counters"]
        assert kv["kv_cache_hit.cond"] == (n - 1) * len(high.blocks)
        assert receipt.plugins["easycache"][expert]["counters"] == {"computed": 2 * n}
    accel.uninstall()
    assert torch.equal(tp.run(), vanilla)


def test_request_ids_are_automatic_or_the_callers():
    tp = wan_t2v(steps=2)
    accel = worldfoundry.accelerate(tp.pipe, {"easycache": {"threshold": 0.0}})
    tp.run()
    tp.run()
    first, second = (c.request_id for c in accel.calls)
    assert first != second
    with accel.request("my-request"):
        tp.run()
    assert accel.last_call.request_id == "my-request"
    assert "my-request" in accel.execution_report()["plugins"]["easycache"]["model"]["requests"]
    accel.uninstall()


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failed_call_ends_its_request_and_the_next_call_is_exact(error):
    tp = wan_t2v()
    vanilla = tp.run()
    accel = worldfoundry.accelerate(tp.pipe, {"easycache": {"threshold": 0.0},
                                              "wan_cross_kv_fusion": {"min_tokens": 0}})
    guard = accel.session.guard

    def fail(pipe, i, t, kwargs):
        if i == 1:
            raise error
        return kwargs

    with pytest.raises(type(error)):
        tp.run(callback_on_step_end=fail)
    assert guard.active_request_ids() == () and guard.active_forwards == 0
    assert accel.last_call.outcome == "failed"
    assert tp.pipe.scheduler.__dict__.get("step") is None
    assert torch.equal(tp.run(), vanilla)
    accel.uninstall()


def test_uninstall_and_cross_thread_moves_are_refused_during_a_call():
    tp = wan_t2v(steps=2)
    accel = worldfoundry.accelerate(tp.pipe, {"easycache": {"threshold": 0.0}})
    seen: dict[str, BaseException | None] = {}

    def during(pipe, i, t, kwargs):
        with pytest.raises(ModelBusyError):
            accel.uninstall()

        def move():
            try:
                pipe.transformer.to(torch.float64)
                seen["move"] = None
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                seen["move"] = exc

        worker = threading.Thread(target=move)
        worker.start()
        worker.join()
        return kwargs

    tp.run(callback_on_step_end=during)
    assert isinstance(seen["move"], ModelBusyError) and "another thread" in str(seen["move"])
    assert tp.pipe.transformer.dtype == torch.float32
    accel.uninstall()


def test_installing_twice_is_refused_and_the_pipeline_copies_only_after_uninstall():
    tp = wan_t2v(steps=2)
    accel = worldfoundry.accelerate(tp.pipe, {"easycache": {"threshold": 0.0}})
    with pytest.raises(SessionAlreadyInstalledError):
        worldfoundry.accelerate(tp.pipe, {"optimized_mha": {}})
    with pytest.raises(InferenceViewError, match="uninstall first"):
        copy.deepcopy(tp.pipe)
    accel.uninstall()
    accel.uninstall()  # idempotent
    clone = copy.deepcopy(tp.pipe)
    assert torch.equal(type(tp)(clone, tp.call_kwargs, tp.kind).run(), tp.run())
    pickle.dumps(tp.pipe.transformer)


def test_calls_outside_a_pipeline_call_keep_their_old_behaviour():
    tp = wan_t2v(steps=2)
    accel = worldfoundry.accelerate(tp.pipe, {"easycache": {"threshold": 0.0}})
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 2, 2), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 6, 16))
    with pytest.raises(RequestError, match="outside a request"):
        tp.pipe.transformer(**inputs)
    accel.uninstall()


def test_an_interrupt_inside_a_forward_leaves_no_stale_forward_state():
    """KeyboardInterrupt skips torch's always-called hooks; the next call still uses the static K/V."""
    tp = wan_t2v()
    vanilla = tp.run()
    accel = worldfoundry.accelerate(tp.pipe, {"easycache": {"threshold": 0.0},
                                              "wan_cross_kv_fusion": {"min_tokens": 0}})
    calls = {"n": 0}

    def interrupt(module, args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt

    hook = tp.pipe.transformer.blocks[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        tp.run()
    hook.remove()
    assert accel.session.guard.active_forwards == 0 and accel.last_call.outcome == "failed"
    assert torch.equal(tp.run(), vanilla)
    counters = accel.last_call.plugins["wan_cross_kv_fusion"]["model"]["counters"]
    assert counters["kv_cache_hit.cond"] == (STEPS - 1) * len(tp.pipe.transformer.blocks)
    assert "kv_cache_concurrent" not in counters
    accel.uninstall()
