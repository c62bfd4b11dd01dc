"""install_diffusion_accelerations: prepare -> conflicts -> transactional activation with exact rollback."""

from __future__ import annotations

import json

import pytest
import torch

from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.prepared import ROLE_FEATURE_CACHE, ROLE_OFFLOAD, ROOT_MODULE
from worldfoundry.core.acceleration.session import SESSION_ATTRIBUTE, get_session, runtime_optimization_report
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import (
    AccelerationConflictError,
    AccelerationInstallError,
    AccelerationOptionsError,
    AccelerationRestoreError,
    PolicyError,
    SessionAlreadyInstalledError,
    UnknownAccelerationError,
)

POLICY = RuntimePolicy(device="cpu", dtype=torch.float32)


@pytest.fixture
def guarded_wan(tiny_wan):
    attach_request_guard(tiny_wan)  # the loader does this before any plugin exists
    return tiny_wan


# ---------------------------------------------------------------------------------------------- happy path


def test_install_changes_output_and_uninstall_restores_exactly(guarded_wan, toy_kit, model_fingerprint,
                                                               assert_restored, run_wan):
    before = model_fingerprint(guarded_wan)
    toy_kit.add("p0")
    toy_kit.add("p1")
    session = install_diffusion_accelerations(guarded_wan, {"p0": {"scale": 2.0}, "p1": True}, POLICY,
                                              registry=toy_kit.registry)
    assert guarded_wan._worldfoundry_accelerations is session
    assert get_session(guarded_wan) is session
    out = run_wan(guarded_wan)
    assert not torch.equal(out, before.output)  # the toy plugin really ran
    assert session.names == ("p0", "p1")
    receipt = session.receipt.to_json()
    assert receipt["execution_verified"] is False
    assert receipt["plugins"][0]["options"] == {"scale": 2.0}
    assert receipt["plugins"][0]["claims"] == ["blocks.0.ffn"]
    assert receipt["plugins"][0]["exact"] is False and receipt["plugins"][1]["exact"] is True
    assert receipt["exact"] is False
    session.uninstall()
    assert toy_kit.events[-2:] == [("deactivate", "p1"), ("deactivate", "p0")]  # reverse activation order
    assert SESSION_ATTRIBUTE not in guarded_wan.__dict__
    assert_restored(before, model_fingerprint(guarded_wan))
    assert [h.released for h in toy_kit.plugins["p0"].handles] == [True]
    session.uninstall()  # idempotent
    assert toy_kit.plugins["p0"].deactivate_count() == 1
    assert session.execution_report()["installed"] is False


def test_activation_order_is_deterministic_by_name(guarded_wan, toy_kit):
    order: list[str] = []
    for name in ("zeta", "alpha", "mid"):
        plugin = toy_kit.add(name)
        original = plugin._activate

        def record(module, scale, _orig=original, _name=name):
            order.append(_name)
            return _orig(module, scale)

        plugin._activate = record
    install_diffusion_accelerations(guarded_wan, {"zeta": True, "mid": True, "alpha": True}, POLICY,
                                    registry=toy_kit.registry).uninstall()
    assert order == ["alpha", "mid", "zeta"]


def test_installer_attaches_a_guard_to_an_unguarded_model(tiny_wan, toy_kit):
    toy_kit.add("p0")
    session = install_diffusion_accelerations(tiny_wan, {"p0": True}, registry=toy_kit.registry)
    assert tiny_wan._worldfoundry_guard is not None
    session.uninstall()


def test_second_install_is_refused_until_uninstall(guarded_wan, toy_kit, model_fingerprint):
    toy_kit.add("p0")
    toy_kit.add("p1")
    session = install_diffusion_accelerations(guarded_wan, {"p0": True}, POLICY, registry=toy_kit.registry)
    with pytest.raises(SessionAlreadyInstalledError, match="uninstall"):
        install_diffusion_accelerations(guarded_wan, {"p1": True}, POLICY, registry=toy_kit.registry)
    assert toy_kit.plugins["p1"].calls["prepare"] == 0
    session.uninstall()
    install_diffusion_accelerations(guarded_wan, {"p1": True}, POLICY, registry=toy_kit.registry).uninstall()


# ---------------------------------------------------------------------------------------------- fault injection

FAULT_CASES = [
    (k, fail_at, mode, undo_fails_at)
    for k in (1, 2, 3)
    for fail_at in range(k)
    for mode in ("clean", "dirty")
    for undo_fails_at in ([None] + list(range(fail_at)))
]


@pytest.mark.parametrize(("k", "fail_at", "mode", "undo_fails_at"), FAULT_CASES)
def test_failed_activation_rolls_back_exactly(make_tiny_wan, toy_kit, model_fingerprint, assert_restored,
                                              k, fail_at, mode, undo_fails_at):
    model = make_tiny_wan()
    attach_request_guard(model)
    before = model_fingerprint(model)
    names = [f"p{i}" for i in range(k)]  # activation order is alphabetical = list order
    for i, name in enumerate(names):
        plugin = toy_kit.add(name)
        if i == fail_at:
            plugin.fail_activate = mode
        if i == undo_fails_at:
            plugin.fail_undo = True
    with pytest.raises(AccelerationInstallError) as info:
        install_diffusion_accelerations(model, {n: {"scale": 1.5} for n in names}, POLICY, registry=toy_kit.registry)
    err = info.value
    assert err.name == names[fail_at]
    assert isinstance(err.__cause__, RuntimeError) and "activation failed" in str(err.__cause__)
    if undo_fails_at is not None:
        assert "rollback error" in str(err)
    for i, name in enumerate(names):
        plugin = toy_kit.plugins[name]
        assert plugin.calls["activate"] == (1 if i <= fail_at else 0)
        assert plugin.deactivate_count() == (1 if i < fail_at else 0)  # the failing one never returned a handle
    # activated in order up to the failing one, then the activated ones deactivated in reverse
    assert toy_kit.events == ([("activate", n) for n in names[: fail_at + 1]]
                              + [("deactivate", n) for n in reversed(names[:fail_at])])
    assert SESSION_ATTRIBUTE not in model.__dict__
    assert_restored(before, model_fingerprint(model))
    # The model is usable again: a clean install and uninstall work.
    clean = toy_kit.add("zz_clean")
    session = install_diffusion_accelerations(model, {"zz_clean": True}, POLICY, registry=toy_kit.registry)
    assert clean.calls["activate"] == 1
    session.uninstall()
    assert_restored(before, model_fingerprint(model))


def test_uninstall_with_a_failing_undo_still_restores_and_detaches(guarded_wan, toy_kit, model_fingerprint,
                                                                   assert_restored):
    before = model_fingerprint(guarded_wan)
    toy_kit.add("p0").fail_undo = True
    toy_kit.add("p1")
    session = install_diffusion_accelerations(guarded_wan, {"p0": True, "p1": True}, POLICY, registry=toy_kit.registry)
    with pytest.raises(AccelerationRestoreError, match="undo failed"):
        session.uninstall()
    assert not session.installed
    assert SESSION_ATTRIBUTE not in guarded_wan.__dict__
    assert session.restore_differences  # the installer's snapshot repaired what the plugin left
    assert_restored(before, model_fingerprint(guarded_wan))
    session.uninstall()  # idempotent, no second error


def test_prepare_that_mutates_the_model_is_rejected_and_repaired(guarded_wan, toy_kit, model_fingerprint,
                                                                 assert_restored):
    before = model_fingerprint(guarded_wan)
    toy_kit.add("p0")
    toy_kit.add("p1").mutate_in_prepare = True
    with pytest.raises(AccelerationInstallError, match="'p1'.*prepare step changed the model"):
        install_diffusion_accelerations(guarded_wan, {"p0": True, "p1": True}, POLICY, registry=toy_kit.registry)
    assert toy_kit.activations() == 0
    assert_restored(before, model_fingerprint(guarded_wan))


def test_prepare_raising_an_unexpected_error_is_wrapped_and_chained(guarded_wan, toy_kit, model_fingerprint,
                                                                    assert_restored):
    before = model_fingerprint(guarded_wan, forward=False)

    def broken(model, options, policy):
        model.blocks[0].half_done = True  # a change, then a crash
        raise RuntimeError("boom in prepare")

    toy_kit.registry.register("broken", broken)
    with pytest.raises(AccelerationInstallError, match="boom in prepare") as info:
        install_diffusion_accelerations(guarded_wan, {"broken": True}, POLICY, registry=toy_kit.registry)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert_restored(before, model_fingerprint(guarded_wan, forward=False))


def test_activate_returning_no_handle_is_rolled_back(guarded_wan, toy_kit, model_fingerprint, assert_restored):
    from worldfoundry.core.acceleration.prepared import PreparedAcceleration

    before = model_fingerprint(guarded_wan)
    toy_kit.add("a_first")

    def factory(model, options, policy):
        def activate():
            model.blocks[1].norm2.stray = 1
            return object()

        return PreparedAcceleration(name="b_bad", claims=frozenset({"blocks.1.norm2"}), activate=activate)

    toy_kit.registry.register("b_bad", factory)
    with pytest.raises(AccelerationInstallError, match="without deactivate"):
        install_diffusion_accelerations(guarded_wan, {"a_first": True, "b_bad": True}, POLICY,
                                        registry=toy_kit.registry)
    assert_restored(before, model_fingerprint(guarded_wan))


# ---------------------------------------------------------------------------------------------- conflicts


def test_shared_claim_conflict_detected_before_any_activation(guarded_wan, toy_kit, model_fingerprint,
                                                              assert_restored):
    before = model_fingerprint(guarded_wan, forward=False)
    toy_kit.add("alpha", "blocks.0.ffn")
    toy_kit.add("beta", "blocks.1.ffn")
    toy_kit.add("gamma", "blocks.0.ffn")
    with pytest.raises(AccelerationConflictError) as info:
        install_diffusion_accelerations(guarded_wan, {"alpha": True, "beta": True, "gamma": True}, POLICY,
                                        registry=toy_kit.registry)
    err = info.value
    assert {err.first, err.second} == {"alpha", "gamma"} and err.resource == "blocks.0.ffn"
    assert "alpha" in str(err) and "gamma" in str(err) and "blocks.0.ffn" in str(err)
    assert all(p.calls["prepare"] == 1 for p in toy_kit.plugins.values())
    assert toy_kit.activations() == 0
    assert_restored(before, model_fingerprint(guarded_wan, forward=False))


def test_shared_role_conflicts(guarded_wan, toy_kit):
    toy_kit.add("cache_a", claims=lambda t: {ROLE_FEATURE_CACHE})
    toy_kit.add("cache_b", claims=lambda t: {ROLE_FEATURE_CACHE})
    with pytest.raises(AccelerationConflictError, match="role:feature_cache"):
        install_diffusion_accelerations(guarded_wan, {"cache_a": True, "cache_b": True}, POLICY,
                                        registry=toy_kit.registry)
    assert toy_kit.activations() == 0


@pytest.mark.parametrize("declared_by", ["first", "second"])
@pytest.mark.parametrize("spec_order", ["ab", "ba"])
@pytest.mark.parametrize("via", ["name", "role"])
def test_declared_incompatibility_both_directions_and_orders(guarded_wan, toy_kit, declared_by, spec_order, via):
    if via == "name":
        a_incompat = frozenset({"beta"}) if declared_by == "first" else frozenset()
        b_incompat = frozenset({"alpha"}) if declared_by == "second" else frozenset()
        toy_kit.add("alpha", incompatible_with=a_incompat)
        toy_kit.add("beta", incompatible_with=b_incompat)
    else:  # alpha takes the offload role; beta cannot run beside offloading (or the reverse)
        if declared_by == "first":
            toy_kit.add("alpha", incompatible_with=frozenset({ROLE_OFFLOAD}))
            toy_kit.add("beta", claims=lambda t: {ROLE_OFFLOAD})
        else:
            toy_kit.add("alpha", claims=lambda t: {ROLE_OFFLOAD})
            toy_kit.add("beta", incompatible_with=frozenset({ROLE_OFFLOAD}))
    spec = {"alpha": True, "beta": True} if spec_order == "ab" else {"beta": True, "alpha": True}
    with pytest.raises(AccelerationConflictError) as info:
        install_diffusion_accelerations(guarded_wan, spec, POLICY, registry=toy_kit.registry)
    assert {info.value.first, info.value.second} == {"alpha", "beta"}
    assert "alpha" in str(info.value) and "beta" in str(info.value)
    if via == "role":
        assert info.value.resource == ROLE_OFFLOAD
    assert toy_kit.activations() == 0


def test_claims_must_name_existing_modules(guarded_wan, toy_kit):
    toy_kit.add("typo", claims=lambda t: {"blocks.0.fnn", ROOT_MODULE, ROLE_FEATURE_CACHE})
    with pytest.raises(AccelerationInstallError, match=r"typo.*blocks\.0\.fnn"):
        install_diffusion_accelerations(guarded_wan, {"typo": True}, POLICY, registry=toy_kit.registry)
    assert toy_kit.activations() == 0


# ---------------------------------------------------------------------------------------------- bad inputs


def test_unknown_acceleration_lists_known_names(guarded_wan, toy_kit, model_fingerprint, assert_restored):
    before = model_fingerprint(guarded_wan, forward=False)
    toy_kit.add("p0")
    toy_kit.add("p1")
    with pytest.raises(UnknownAccelerationError) as info:
        install_diffusion_accelerations(guarded_wan, {"p0": True, "nope": True}, POLICY, registry=toy_kit.registry)
    message = str(info.value)
    assert "'nope'" in message and "p0, p1" in message
    assert toy_kit.plugins["p0"].calls["prepare"] == 0
    assert_restored(before, model_fingerprint(guarded_wan, forward=False))


@pytest.mark.parametrize("options", [3, "fast", [1, 2], 0.5])
def test_non_mapping_options_are_rejected(guarded_wan, toy_kit, options):
    toy_kit.add("p0")
    with pytest.raises(PolicyError, match="p0"):
        install_diffusion_accelerations(guarded_wan, {"p0": options}, POLICY, registry=toy_kit.registry)
    assert toy_kit.plugins["p0"].calls["prepare"] == 0


def test_non_mapping_spec_is_rejected(guarded_wan, toy_kit):
    with pytest.raises(PolicyError, match="mapping"):
        install_diffusion_accelerations(guarded_wan, ["p0"], POLICY, registry=toy_kit.registry)


def test_unknown_option_keys_are_named(guarded_wan, toy_kit, model_fingerprint, assert_restored):
    before = model_fingerprint(guarded_wan, forward=False)
    toy_kit.add("p0")
    toy_kit.add("p1")
    with pytest.raises(AccelerationOptionsError, match=r"p1: unknown option\(s\) \['scael'\]"):
        install_diffusion_accelerations(guarded_wan, {"p0": True, "p1": {"scael": 2}}, POLICY,
                                        registry=toy_kit.registry)
    assert toy_kit.activations() == 0
    assert_restored(before, model_fingerprint(guarded_wan, forward=False))


def test_false_and_none_entries_are_skipped(guarded_wan, toy_kit):
    toy_kit.add("p0")
    toy_kit.add("p1")
    session = install_diffusion_accelerations(guarded_wan, {"p0": False, "p1": None}, POLICY,
                                              registry=toy_kit.registry)
    assert session.names == ()
    assert toy_kit.plugins["p0"].calls["prepare"] == 0
    session.uninstall()


# ---------------------------------------------------------------------------------------------- reports


def test_runtime_report_is_json_and_shows_unexecuted_claims(guarded_wan, toy_kit, run_wan):
    from worldfoundry.core.acceleration.context import RequestContext, request_scope

    toy_kit.add("p0", "blocks.0.ffn")
    toy_kit.add("p1", "proj_out")
    session = install_diffusion_accelerations(guarded_wan, {"p0": True, "p1": True}, POLICY,
                                              registry=toy_kit.registry)
    with request_scope(RequestContext("r1")):
        run_wan(guarded_wan)
    report = runtime_optimization_report(guarded_wan)
    json.dumps(report)
    assert report["execution_verified"] is False
    r1 = report["plugins"]["p0"]["model"]["requests"]["r1"]
    assert r1["modules"] == {"blocks.0.ffn": {"toy": 1}}
    assert r1["claimed_not_executed"] == []
    # a request that ran only part of the model: proj_out executed, the block wrapper never did
    guarded_wan.get_submodule("blocks.0.ffn")  # (sanity: the claimed path exists)
    toy_kit.plugins["p0"].handles[0].ledger.count("calls", request_id="r2")
    report = session.execution_report()
    assert report["plugins"]["p0"]["model"]["requests"]["r2"]["claimed_not_executed"] == ["blocks.0.ffn"]
    assert report["plugins"]["p0"]["model"]["claims"] == ["blocks.0.ffn"]
    session.uninstall()
    final = session.execution_report()
    assert final["installed"] is False and "r1" in final["plugins"]["p0"]["model"]["requests"]
    final["plugins"].clear()
    assert session.execution_report()["plugins"]  # callers get copies


# ---------------------------------------------------------------------------------------------- freeing, threads


def test_uninstall_frees_derived_tensors(guarded_wan, toy_kit):
    import weakref

    from worldfoundry.core.acceleration.handle import RecordedHandle
    from worldfoundry.core.acceleration.patching import PatchRecorder
    from worldfoundry.core.acceleration.prepared import PreparedAcceleration

    refs: list[weakref.ref] = []

    class PackingHandle(RecordedHandle):
        def release(self) -> None:
            self.packed = None

    def factory(model, options, policy):
        def activate():
            with PatchRecorder("packing") as rec:
                packed = torch.cat([model.proj_out.weight.detach(), model.proj_out.weight.detach()])
                refs.append(weakref.ref(packed))
                rec.register_buffer(model.proj_out, "packed_weight", packed)
                patches = rec.pop_all()
            handle = PackingHandle("packing", patches)
            handle.packed = packed
            return handle

        return PreparedAcceleration(name="packing", claims=frozenset({"proj_out"}), activate=activate)

    toy_kit.registry.register("packing", factory)
    session = install_diffusion_accelerations(guarded_wan, {"packing": True}, POLICY, registry=toy_kit.registry)
    assert refs[0]() is not None
    session.uninstall()
    assert refs[0]() is None  # no reference left anywhere: freed without waiting for the garbage collector
    assert session.handles("packing") == {}


def test_concurrent_installs_one_wins(guarded_wan, toy_kit):
    import threading

    slow = toy_kit.add("slow", "blocks.0.ffn")
    toy_kit.add("fast", "blocks.1.ffn")
    entered, release = threading.Event(), threading.Event()
    original = slow._activate

    def held_activate(module, scale):
        entered.set()
        release.wait(timeout=30)
        return original(module, scale)

    slow._activate = held_activate
    results: dict[str, object] = {}
    thread = threading.Thread(target=lambda: results.setdefault(
        "slow", install_diffusion_accelerations(guarded_wan, {"slow": True}, POLICY, registry=toy_kit.registry)))
    thread.start()
    assert entered.wait(timeout=30)
    from worldfoundry.errors import ModelBusyError

    with pytest.raises(ModelBusyError, match="install/uninstall is in progress") as info:
        install_diffusion_accelerations(guarded_wan, {"fast": True}, POLICY, registry=toy_kit.registry)
    assert info.value.mutating
    guard = guarded_wan._worldfoundry_guard
    with pytest.raises(ModelBusyError):
        guard.begin_request("during-install")
    release.set()
    thread.join(timeout=30)
    session = results["slow"]
    assert guarded_wan._worldfoundry_accelerations is session
    with pytest.raises(SessionAlreadyInstalledError):
        install_diffusion_accelerations(guarded_wan, {"fast": True}, POLICY, registry=toy_kit.registry)
    session.uninstall()
