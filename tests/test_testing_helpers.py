"""``worldfoundry.testing`` and ``worldfoundry.core.timing``: deterministic builders, a restore check that fails."""

from __future__ import annotations

import pytest
import torch

from worldfoundry import testing
from worldfoundry.core.timing import Region, time_calls, time_ms

CPU = torch.device("cpu")


def test_builders_are_seeded_and_leave_the_random_state_alone() -> None:
    state = torch.random.get_rng_state()
    a, b = testing.tiny_wan(3), testing.tiny_wan(3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(testing.tiny_wan(4).proj_out.weight, a.proj_out.weight)
    assert not a.training and a.proj_out.weight.dtype == torch.float32
    assert testing.tiny_wan(dtype=torch.bfloat16, num_layers=1).proj_out.weight.dtype == torch.bfloat16
    reseeded = testing.tiny_wan(0, weight_scale=0.1, weight_seed=9)
    assert torch.equal(reseeded.proj_out.weight, testing.tiny_wan(1, weight_scale=0.1, weight_seed=9).proj_out.weight)


def test_seeded_model_takes_the_whole_config_and_builds_on_a_device() -> None:
    from diffusers import WanTransformer3DModel

    config = {**testing.WAN_TINY, "num_layers": 1}
    model = testing.seeded_model(WanTransformer3DModel, 2, **config)
    assert {k: model.config[k] for k in config} == config and not model.training
    tiny = testing.tiny_wan(2, weight_scale=None, num_layers=1)  # the tiny builder adds only its defaults
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), tiny.state_dict().values(), strict=True))
    on_meta = testing.seeded_model(WanTransformer3DModel, 2, device="meta", **config)
    assert on_meta.proj_out.weight.is_meta


@pytest.mark.parametrize("family", ["wan", "wan22", "sana_video", "minimax_h3"])
def test_every_family_builds_and_runs(family: str) -> None:
    if family == "wan22":
        experts = testing.guarded(testing.tiny_wan22_experts())
        assert set(experts) == {"high", "low"}
        guards = {id(m.__dict__["_worldfoundry_guard"]) for m in experts.values()}
        assert len(guards) == 1  # one guard for the group
        out = testing.run_model(experts["low"], testing.wan_inputs(experts["low"]))
    elif family == "wan":
        model = testing.tiny_wan()
        out = testing.run_model(model, testing.wan_inputs(model, frames=2))
    elif family == "sana_video":
        model = testing.tiny_sana_video()
        out = testing.run_model(model, testing.sana_video_inputs(model))
    else:
        model = testing.tiny_minimax_h3()
        out = testing.run_model(model, testing.minimax_h3_inputs(model))
    assert torch.isfinite(out).all()


def test_assert_restored_sees_every_kind_of_change() -> None:
    model = testing.tiny_wan(num_layers=1)
    before = testing.fingerprint(model)
    testing.assert_restored(model, before)
    saved = model.proj_out.weight.detach().clone()
    changes = [
        ("weight value", lambda m: m.proj_out.weight.data.add_(1.0), lambda m: m.proj_out.weight.data.copy_(saved)),
        ("attribute", lambda m: setattr(m.proj_out, "extra", 1), lambda m: delattr(m.proj_out, "extra")),
        ("hook", lambda m: setattr(m, "_h", m.proj_out.register_forward_hook(lambda *a: None)),
         lambda m: (m._h.remove(), delattr(m, "_h"))),
    ]
    for _label, change, undo in changes:
        change(model)
        with pytest.raises(AssertionError):
            testing.assert_restored(model, before)
        undo(model)
        testing.assert_restored(model, before)
    original = model.proj_out.weight
    model.proj_out.weight = torch.nn.Parameter(original.detach().clone())  # equal values, another object
    with pytest.raises(AssertionError, match="parameter identities|dictionaries"):
        testing.assert_restored(model, before)


def test_timing_on_the_cpu() -> None:
    calls = []
    assert time_ms(lambda: calls.append(1), CPU, iters=4) >= 0.0 and len(calls) == 4
    region = time_calls(lambda: torch.ones(8).sum(), CPU, 3)
    assert region.device_ms == region.wall_ms == region.enqueue_ms >= 0.0
    with Region(CPU, sync_before=False) as r:
        torch.ones(2)
    assert r.wall_ms >= 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_timing_on_the_gpu() -> None:
    device = torch.device("cuda")
    x = torch.randn(2048, 2048, device=device)
    with Region(device) as region:
        for _ in range(4):
            x @ x
    assert region.device_ms > 0.0 and region.wall_ms >= region.enqueue_ms
    assert time_ms(lambda: x @ x, device, 3) > 0.0


def test_run_request_owns_the_request_and_scopes_every_call() -> None:
    from worldfoundry.core.acceleration.context import current_request
    from worldfoundry.core.acceleration.guard import get_request_guard

    model = testing.tiny_wan(num_layers=1)
    seen: list[tuple] = []

    def call(step: int, branch: str) -> torch.Tensor:
        ctx = current_request()
        seen.append((ctx.request_id, ctx.branch, ctx.step_index, ctx.timestep, ctx.num_steps,
                     get_request_guard(model).active_request_ids()))
        return torch.tensor(float(step))

    outputs = testing.run_request(model, "r1", call, steps=2, timestep=lambda s: 900 - 100 * s,
                                  before_step=lambda s: seen.append(("before", s)))
    assert [float(o) for o in outputs] == [0.0, 0.0, 1.0, 1.0]
    owned = ("r1",)
    assert seen == [("before", 0), ("r1", "cond", 0, 900.0, 2, owned), ("r1", "uncond", 0, 900.0, 2, owned),
                    ("before", 1), ("r1", "cond", 1, 800.0, 2, owned), ("r1", "uncond", 1, 800.0, 2, owned)]
    assert get_request_guard(model).active_request_ids() == ()  # the request ended
