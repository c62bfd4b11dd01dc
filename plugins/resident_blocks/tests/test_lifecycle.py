"""Request lifecycle: residents built once per request, released at its end and after exceptions, rebuilt by
the next request; exact restore; refusal while busy; receipts; guards against misuse."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.errors import InferenceViewError, ModelBusyError, RequestError

SPEC = {"resident_blocks": {"offload_resident_blocks": 2, "cpu_offload_block_contiguous": True}}


def _install(model, registry, spec=SPEC):
    session = install_diffusion_accelerations(model, spec, registry=registry)
    return session, session.handles("resident_blocks")["model"]


def _snapshot(model) -> dict:
    return {
        "param_ids": {n: id(p) for n, p in model.named_parameters()},
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "devices": {n: p.device for n, p in model.named_parameters()},
        "dicts": {n: (dict(m._parameters), dict(m._modules), dict(m._forward_hooks), dict(m._forward_pre_hooks),
                      {k: v for k, v in m.__dict__.items() if k == "forward"})
                  for n, m in model.named_modules()},
    }


def test_exact_restore_on_uninstall(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    attach_request_guard(model)
    reference = tiny.wan_forward(model)
    before = _snapshot(model)
    session, handle = _install(model, registry)
    assert "forward" in model.blocks[0].__dict__  # wrapped
    tiny.run_request(model, "r1", steps=2)
    session.uninstall()
    after = _snapshot(model)
    assert after["param_ids"] == before["param_ids"]
    assert after["devices"] == before["devices"]
    assert list(after["state"]) == list(before["state"])
    for key, value in before["state"].items():
        assert torch.equal(after["state"][key], value), key
    assert after["dicts"] == before["dicts"]
    assert torch.equal(tiny.wan_forward(model), reference)
    assert session.restore_differences == []
    assert handle.active is False
    session.uninstall()  # idempotent


def test_state_dict_while_installed_holds_the_same_values(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    session, _ = _install(model, registry)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    session.uninstall()


def test_residents_live_for_the_request_only(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    guard = attach_request_guard(model)
    session, handle = _install(model, registry)
    engine = handle.engine
    assert engine.device_bytes()["total"] == 0
    with guard.request("r1"):
        held = engine.device_bytes()
        assert held["resident_bytes"] > 0  # built at request start, before any forward
        for step in range(3):
            with request_scope(RequestContext("r1", "cond", step)):
                tiny.wan_forward(model)
            assert engine.device_bytes()["resident_bytes"] == held["resident_bytes"]
    assert engine.device_bytes() == {"resident_bytes": 0, "slot_bytes": 0, "total": 0}
    receipt = handle.receipts["r1"]
    assert receipt.resident_builds == 1 and receipt.forwards == 3  # never rebuilt per step
    tiny.run_request(model, "r2", steps=1)
    assert handle.receipts["r2"].resident_builds == 1  # rebuilt by the next request
    assert engine.device_bytes()["total"] == 0
    session.uninstall()


class _Boom(RuntimeError):
    pass


def test_exception_releases_residents_and_the_request_recovers(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    reference = tiny.wan_forward(model)
    guard = attach_request_guard(model)
    session, handle = _install(model, registry)
    engine = handle.engine
    armed = {"on": False}

    def explode(module, args):
        if armed["on"]:
            raise _Boom("injected failure inside a streamed block")

    hook = model.blocks[1].ffn.register_forward_pre_hook(explode)  # block 1 is streamed (indices 0, 2)
    masters = [p.data_ptr() for p in model.blocks[1].parameters()]
    with guard.request("r1"):
        armed["on"] = True
        with pytest.raises(_Boom):
            with request_scope(RequestContext("r1", "cond", 0)):
                tiny.wan_forward(model)
        assert engine.device_bytes()["resident_bytes"] == 0  # released on the exception
        assert [p.data_ptr() for p in model.blocks[1].parameters()] == masters  # back on the host masters
        assert not engine.in_forward
        armed["on"] = False
        with request_scope(RequestContext("r1", "cond", 0)):
            assert torch.equal(tiny.wan_forward(model), reference)  # rebuilt lazily, still exact
    receipt = handle.receipts["r1"]
    assert receipt.failed_forwards == 1 and receipt.forwards == 2 and receipt.resident_builds == 2
    hook.remove()
    session.uninstall()
    assert torch.equal(tiny.wan_forward(model), reference)


def test_aborted_request_releases_everything(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    guard = attach_request_guard(model)
    session, handle = _install(model, registry)
    with pytest.raises(_Boom):
        with guard.request("r1"):
            with request_scope(RequestContext("r1", "cond", 0)):
                tiny.wan_forward(model)
            raise _Boom("the runner failed between steps")
    assert handle.engine.device_bytes()["total"] == 0
    assert guard.active_request_ids() == ()
    assert handle.receipts["r1"].forwards == 1
    session.uninstall()


def test_refusal_while_busy(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    guard = attach_request_guard(model)
    with guard.request("busy"):
        with pytest.raises(ModelBusyError):
            install_diffusion_accelerations(model, SPEC, registry=registry)
    session, _ = _install(model, registry)
    with guard.request("busy2"):
        with pytest.raises(ModelBusyError):
            session.uninstall()
    session.uninstall()


def test_one_request_at_a_time(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    guard = attach_request_guard(model)
    session, handle = _install(model, registry)
    with guard.request("first"):
        with pytest.raises(ModelBusyError, match="first"):
            guard.begin_request("second")
        assert guard.active_request_ids() == ("first",)
    assert handle.engine.device_bytes()["total"] == 0
    session.uninstall()


def test_forward_outside_a_request_is_its_own_request(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    reference = tiny.wan_forward(model)
    session, handle = _install(model, registry)
    assert torch.equal(tiny.wan_forward(model), reference)
    receipt = handle.receipts["<no-request>"]
    assert receipt.forwards == 1 and receipt.resident_builds == 1 and receipt.transfers == 2
    assert handle.engine.device_bytes()["total"] == 0
    session.uninstall()


def test_standalone_block_call(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    captured = {}

    def grab(module, args, kwargs):
        captured["args"] = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)

    hook = model.blocks[3].register_forward_pre_hook(grab, with_kwargs=True)
    tiny.wan_forward(model)
    hook.remove()
    args = captured["args"]
    args = args[:3] + (tuple(t.clone() for t in args[3]),)
    with torch.no_grad():
        expected = model.blocks[3](*args)
    session, handle = _install(model, registry)
    with torch.no_grad():
        got = model.blocks[3](*args)
    assert torch.equal(got, expected)
    receipt = handle.receipts["<no-request>"]
    assert receipt.transfers == 1 and receipt.discarded == 0 and receipt.resident_builds == 0
    with torch.no_grad():  # a resident block called on its own outside a request streams through a slot
        model.blocks[0](*args)
    assert handle.receipts["<no-request>"].first_forward_transfers == ((0, 0),)
    session.uninstall()


@pytest.mark.parametrize("move", ["to", "double", "half", "block"])
def test_moving_the_model_while_installed_is_refused_at_the_call(tiny, registry, move) -> None:
    model = tiny.make_tiny_wan()
    reference = tiny.wan_forward(model)
    session, _ = _install(model, registry)
    calls = {"to": lambda: model.to(torch.float64), "double": model.double, "half": model.half,
             "block": lambda: model.blocks[0].to(torch.float64)}
    with pytest.raises(InferenceViewError, match="uninstall resident_blocks first"):
        calls[move]()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(tiny.wan_forward(model), reference)
    session.uninstall()
    model.to(torch.float64)  # the advice works: after uninstall the move runs and the model is consistent
    assert all(p.dtype == torch.float64 for p in model.parameters())


def test_weights_written_during_a_request_are_kept(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    guard = attach_request_guard(model)
    session, handle = _install(model, registry)
    new = torch.full_like(model.blocks[0].ffn.net[2].bias, 0.25)
    with guard.request("edit"):
        with torch.no_grad():
            model.blocks[0].ffn.net[2].bias.copy_(new)  # block 0 is resident: the device copy is written
    assert handle.receipts["edit"].weights_written_back == 1
    assert torch.equal(model.state_dict()["blocks.0.ffn.net.2.bias"], new)
    session.uninstall()
    assert torch.equal(model.blocks[0].ffn.net[2].bias, new)


def test_request_ids_are_checked_by_the_guard(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    guard = attach_request_guard(model)
    session, handle = _install(model, registry)
    with pytest.raises(RequestError):
        guard.end_request("never-begun")
    assert handle.engine.end_request("never-begun") is None
    session.uninstall()


def test_execution_report_states_what_is_held(tiny, registry) -> None:
    model = tiny.make_tiny_wan()
    session, handle = _install(model, registry)
    report = handle.execution_report()
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    assert report["offload"]["num_blocks"] == 4 and report["offload"]["resident_indices"] == [0, 2]
    assert report["offload"]["block_bytes"] == block_bytes
    assert report["host_bytes"] >= block_bytes  # contiguous slabs are padded
    assert report["pinned_bytes"] == 0 and report["pin_method"] is None  # emulated: nothing page-locked
    assert report["device_bytes"]["total"] == 0  # nothing held between requests
    json_safe = __import__("json").dumps(session.execution_report())
    assert "resident_blocks" in json_safe
    session.uninstall()
    assert handle.execution_report()["device_bytes"] == {"total": 0}
