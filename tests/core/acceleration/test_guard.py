"""RequestGuard: forwards and explicit requests block install/uninstall; guard groups; request id errors."""

from __future__ import annotations

import threading

import pytest
import torch

from worldfoundry.core.acceleration.guard import RequestGuard, attach_request_guard, get_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.session import SESSION_ATTRIBUTE
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import ModelBusyError, RequestError

POLICY = RuntimePolicy(device="cpu", dtype=torch.float32)


class BlockedForward:
    """Runs a forward of ``model`` in a thread that stops inside ``plugin``'s patched submodule forward."""

    def __init__(self, model, plugin, run_wan) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        plugin.entered_event = self.entered
        plugin.block_event = self.release
        self.plugin = plugin
        self.error: BaseException | None = None
        self.output = None

        def target() -> None:
            try:
                self.output = run_wan(model)
            except BaseException as exc:  # surfaced by finish()
                self.error = exc

        self.thread = threading.Thread(target=target, daemon=True)

    def __enter__(self) -> BlockedForward:
        self.thread.start()
        assert self.entered.wait(timeout=30), "the forward never reached the patched submodule"
        return self

    def finish(self) -> None:
        self.release.set()
        self.thread.join(timeout=30)
        self.plugin.block_event = None
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error

    def __exit__(self, *exc: object) -> None:
        if self.thread.is_alive():
            self.finish()


def test_forward_in_another_thread_blocks_install_and_uninstall(tiny_wan, toy_kit, run_wan, model_fingerprint,
                                                                assert_restored):
    guard = attach_request_guard(tiny_wan)
    before = model_fingerprint(tiny_wan)
    probe = toy_kit.add("probe", "blocks.0.ffn")
    other = toy_kit.add("other", "blocks.1.ffn")
    session = install_diffusion_accelerations(tiny_wan, {"probe": True}, POLICY, registry=toy_kit.registry)
    with BlockedForward(tiny_wan, probe, run_wan) as blocked:
        assert guard.active_forwards == 1 and guard.is_busy()
        with pytest.raises(ModelBusyError, match="1 forward call") as info:
            session.uninstall()
        assert info.value.active_forwards == 1
        assert session.installed and tiny_wan._worldfoundry_accelerations is session
        blocked.finish()
    assert guard.active_forwards == 0
    session.uninstall()
    assert SESSION_ATTRIBUTE not in tiny_wan.__dict__

    # the same for install: block inside a submodule wrapped outside any session
    from worldfoundry.core.acceleration.patching import PatchRecorder

    entered, release = threading.Event(), threading.Event()

    def make_wrapper(original):
        def forward(*args, **kwargs):
            entered.set()
            release.wait(timeout=30)
            return original(*args, **kwargs)

        return forward

    with PatchRecorder() as rec:
        rec.wrap_forward(tiny_wan.blocks[1].norm2, make_wrapper, name="test-block")
        thread = threading.Thread(target=run_wan, args=(tiny_wan,), daemon=True)
        thread.start()
        assert entered.wait(timeout=30)
        with pytest.raises(ModelBusyError, match="cannot install"):
            install_diffusion_accelerations(tiny_wan, {"other": True}, POLICY, registry=toy_kit.registry)
        assert other.calls["prepare"] == 0
        release.set()
        thread.join(timeout=30)
    assert guard.active_forwards == 0
    install_diffusion_accelerations(tiny_wan, {"other": True}, POLICY, registry=toy_kit.registry).uninstall()
    assert_restored(before, model_fingerprint(tiny_wan))


def test_open_request_blocks_install_and_uninstall(tiny_wan, toy_kit):
    guard = attach_request_guard(tiny_wan)
    toy_kit.add("p0")
    guard.begin_request("req-A")
    with pytest.raises(ModelBusyError) as info:
        install_diffusion_accelerations(tiny_wan, {"p0": True}, POLICY, registry=toy_kit.registry)
    assert info.value.request_ids == ("req-A",) and "'req-A'" in str(info.value)
    guard.end_request("req-A")
    session = install_diffusion_accelerations(tiny_wan, {"p0": True}, POLICY, registry=toy_kit.registry)
    handle = session.handles("p0")["model"]
    with guard.request("req-B"):
        assert handle.requests == ["req-B"]  # the session forwards begin/end to its handles
        with pytest.raises(ModelBusyError, match="req-B"):
            session.uninstall()
        assert session.installed
    assert handle.requests == []
    session.uninstall()
    assert not guard.is_busy()


def test_request_ids_must_be_unique_and_known(tiny_wan):
    guard = attach_request_guard(tiny_wan)
    guard.begin_request("r1")
    with pytest.raises(RequestError, match="'r1' is already active"):
        guard.begin_request("r1")
    with pytest.raises(RequestError, match="'r2' is not active"):
        guard.end_request("r2")
    with pytest.raises(RequestError, match="non-empty string"):
        guard.begin_request("")
    guard.end_request("r1")
    with pytest.raises(RequestError, match="'r1' is not active"):
        guard.end_request("r1")
    with pytest.raises(ValueError, match="boom"):
        with guard.request("r3"):
            raise ValueError("boom")
    assert guard.active_request_ids() == ()


def test_failing_listener_does_not_leak_request_state(tiny_wan, toy_kit):
    guard = attach_request_guard(tiny_wan)
    toy_kit.add("a_ok")
    refusing = toy_kit.add("b_refuses")
    session = install_diffusion_accelerations(tiny_wan, {"a_ok": True, "b_refuses": True}, POLICY,
                                              registry=toy_kit.registry)
    refusing.fail_begin = True
    with pytest.raises(RuntimeError, match="refuses request r1"):
        guard.begin_request("r1")
    assert guard.active_request_ids() == ()
    assert session.handles("a_ok")["model"].requests == []  # the handle that had begun was ended again
    refusing.fail_begin = False
    with guard.request("r1"):
        pass
    session.uninstall()


def test_guard_group_guards_both_experts(make_tiny_wan, toy_kit, run_wan, model_fingerprint, assert_restored):
    high, low = make_tiny_wan(0), make_tiny_wan(1)
    guard = attach_request_guard(high)
    assert attach_request_guard(low, guard) is guard
    assert attach_request_guard(low) is guard  # idempotent
    before = {"high": model_fingerprint(high), "low": model_fingerprint(low)}
    probe = toy_kit.add("probe", "blocks.0.ffn")
    experts = {"high": high, "low": low}
    session = install_diffusion_accelerations(experts, {"probe": {"scale": 1.0}}, POLICY, registry=toy_kit.registry)
    assert probe.calls["prepare"] == 2 and probe.calls["activate"] == 2  # once per expert, one session
    assert high._worldfoundry_accelerations is session and low._worldfoundry_accelerations is session
    assert set(session.handles("probe")) == {"high", "low"}
    assert session.receipt.experts == ("high", "low")
    assert session.receipt.plugins[0].claims == ("high/blocks.0.ffn", "low/blocks.0.ffn")

    with BlockedForward(high, probe, run_wan):  # a forward in one expert blocks changes to the group
        with pytest.raises(ModelBusyError):
            session.uninstall()
    guard.begin_request("r1")
    with pytest.raises(ModelBusyError, match="r1"):
        session.uninstall()
    assert [h.requests for h in session.handles("probe").values()] == [["r1"], ["r1"]]
    guard.end_request("r1")
    session.uninstall()
    for label, model in experts.items():
        assert SESSION_ATTRIBUTE not in model.__dict__
        assert_restored(before[label], model_fingerprint(model))

    # a request open on the group blocks an install on one expert alone
    with guard.request("r2"), pytest.raises(ModelBusyError):
        install_diffusion_accelerations(low, {"probe": True}, POLICY, registry=toy_kit.registry)


def test_experts_with_different_guards_are_refused(make_tiny_wan, toy_kit):
    high, low = make_tiny_wan(0), make_tiny_wan(1)
    attach_request_guard(high)
    attach_request_guard(low)
    toy_kit.add("p0")
    with pytest.raises(ValueError, match="different request guards"):
        install_diffusion_accelerations({"high": high, "low": low}, {"p0": True}, POLICY, registry=toy_kit.registry)
    with pytest.raises(ValueError, match="different request guard"):
        attach_request_guard(low, get_request_guard(high))


def test_forward_during_mutation_is_refused_and_counters_stay_balanced(tiny_wan, run_wan):
    guard = attach_request_guard(tiny_wan)
    with guard.mutation("test"):
        with pytest.raises(ModelBusyError, match="run a forward"):
            run_wan(tiny_wan)
        with pytest.raises(ModelBusyError, match="begin a request"):
            guard.begin_request("r1")
        with pytest.raises(ModelBusyError, match="in progress"):
            guard.ensure_idle("nest")
    assert guard.active_forwards == 0 and not guard.is_busy()
    run_wan(tiny_wan)
    assert guard.active_forwards == 0


def test_concurrent_forwards_are_counted(tiny_wan, run_wan):
    guard = RequestGuard("test")
    attach_request_guard(tiny_wan, guard)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(3):
                run_wan(tiny_wan)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and guard.active_forwards == 0


def test_release_thread_forwards_after_an_interrupted_forward(tiny_wan):
    guard = attach_request_guard(tiny_wan)
    guard._enter_forward(tiny_wan, ())  # as if a KeyboardInterrupt skipped the exit hook
    assert guard.active_forwards == 1
    assert guard.release_thread_forwards() == 1
    assert guard.active_forwards == 0 and guard.release_thread_forwards() == 0
