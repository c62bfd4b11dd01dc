"""The diffusers fused-branch path: which sites use it, one GEMM per group, exact restore, fallbacks, receipts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from worldfoundry_optimized_mha.plan import FUSED_BRANCH, PROJECTION_WRAPPERS

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.attention.fused_projection import NOT_BITWISE
from worldfoundry.core.attention.packed_projection import PackedProjection
from worldfoundry.errors import AccelerationRefusedError

EXPECTED_PATHS = {"wan": FUSED_BRANCH, "wan-i2v": FUSED_BRANCH, "h3": FUSED_BRANCH, "sana": PROJECTION_WRAPPERS}
BRANCH_ATTRIBUTES = {"self": ("to_qkv",), "cross": ("to_kv",), "cross-i2v": ("to_kv", "to_added_kv")}


class GemmCounter(TorchDispatchMode):
    """Counts matrix multiplications (every Linear is one addmm/mm)."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm, torch.ops.aten.bmm):
            self.gemms += 1
        return func(*args, **(kwargs or {}))


def _record(session, request_id: str = "<no-request>") -> dict:
    requests = session.execution_report()["plugins"]["optimized_mha"]["model"]["requests"]
    return requests.get(request_id, {"counters": {}})


def _attributes(case, path: str) -> tuple[str, ...]:
    kind = "self" if path in case.self_paths else "cross"
    return BRANCH_ATTRIBUTES["cross-i2v" if kind == "cross" and case.name == "wan-i2v" else kind]


def test_each_family_uses_its_path_with_one_gemm_per_group(case, registry) -> None:
    model = case.model
    paths = [*case.self_paths, *case.cross_paths]
    with GemmCounter() as counter:
        dense = case.run(0)
    dense_gemms = counter.gemms
    before = {p: dict(model.get_submodule(p).__dict__) for p in paths}
    attach_request_guard(model)  # the loader attaches it before any plugin (install would otherwise)
    root_hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    n_params, keys = len(list(model.parameters())), list(model.state_dict())

    session = install_diffusion_accelerations(model, {"optimized_mha": {}}, registry=registry)
    report = session.execution_report()["plugins"]["optimized_mha"]["model"]
    assert report["projection_paths"] == {EXPECTED_PATHS[case.name]: len(paths)}
    assert any(EXPECTED_PATHS[case.name] in note for note in session.receipt.plugins[0].notes)
    for path in paths:
        site = report["sites"][path]
        assert site["projection_path"] == EXPECTED_PATHS[case.name]
        module = model.get_submodule(path)
        if EXPECTED_PATHS[case.name] == FUSED_BRANCH:
            assert module.__dict__["fused_projections"] is True
            for attribute in _attributes(case, path):
                projection = module.__dict__[attribute]
                assert isinstance(projection, PackedProjection) and not isinstance(projection, nn.Module)
                assert attribute not in module._modules
        else:
            assert "no fused-projection branch" in site["projection_path_reason"]
    assert len(list(model.parameters())) == n_params and list(model.state_dict()) == keys

    # The first call of a geometry (shape, strides, alignment) runs fused and separate GEMMs: count GEMMs in a run
    # without new checks. Every fused group call saves (members - 1) GEMMs: self 3 -> 1, cross K/V 2 -> 1.
    for _ in range(8):
        before_run = _record(session)["counters"]
        with GemmCounter() as counter:
            out = case.run(0)
        assert torch.equal(out, dense)
        after_run = _record(session)["counters"]
        if after_run.get("bitwise_checks", 0) == before_run.get("bitwise_checks", 0):
            break
    else:
        pytest.fail("every run met a new input geometry")
    fused = {k: after_run.get(k, 0) - before_run.get(k, 0) for k in ("fused_qkv", "fused_kv", "fused_added_kv")}
    assert fused["fused_qkv"] > 0
    saved = fused["fused_qkv"] // 3 * 2 + fused["fused_kv"] // 2 + fused["fused_added_kv"] // 2
    assert dense_gemms - counter.gemms == saved
    if after_run.get("dense_fallback", 0) == before_run.get("dense_fallback", 0):  # all groups fused in that run
        assert saved == 2 * len(case.self_paths) + len(case.cross_paths) * (2 if case.name == "wan-i2v" else 1)

    if EXPECTED_PATHS[case.name] == FUSED_BRANCH:  # the per-forward validation hooks
        assert len(model._forward_pre_hooks) == len(root_hooks[0]) + 1
    session.uninstall()
    assert session.restore_differences == []
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == root_hooks
    for path in paths:
        assert dict(model.get_submodule(path).__dict__) == before[path]  # fused_projections and attributes restored
        assert model.get_submodule(path).fused_projections is False
    assert torch.equal(case.run(0), dense)


def test_receipts_fold_cheap_counters_per_request(wan_case, registry) -> None:
    session = install_diffusion_accelerations(wan_case.model, {"optimized_mha": {}}, registry=registry)
    handle = session.handles("optimized_mha")["model"]
    with torch.no_grad():
        for rid, calls in (("a", 2), ("b", 3)):
            with request_scope(RequestContext(rid, "cond", 0)):
                for _ in range(calls):
                    wan_case.run(0)
    handle.end_request("a")
    a, b = _record(session, "a"), _record(session, "b")
    assert a["finished"] is True and b["finished"] is False
    for record, calls in ((a, 2), (b, 3)):
        assert all(record["modules"][f"blocks.{i}.attn1.{p}"] == {"fused_qkv": calls}
                   for i in (0, 1) for p in ("to_q", "to_k", "to_v"))
        assert all(record["modules"][f"blocks.{i}.attn2.{p}"] == {"fused_kv": calls} for i in (0, 1) for p in ("to_k", "to_v"))
        assert record["counters"]["fused_qkv"] == 2 * 3 * calls and record["counters"]["fused_kv"] == 2 * 2 * calls
        assert record["fallbacks"] == {} and record["claimed_not_executed"] == []
    # each of the 4 groups checks every new input geometry once (on the CPU the pointer alignment varies)
    assert a["counters"]["bitwise_checks"] >= 4
    verdicts = session.execution_report()["plugins"]["optimized_mha"]["model"]["packed_groups"]
    assert all(g["projection_path"] == FUSED_BRANCH and all(g["bitwise_checks"].values()) for g in verdicts.values())
    assert session.execution_report()["plugins"]["optimized_mha"]["model"]["added_weight_bytes"] == 0
    session.uninstall()


@pytest.mark.parametrize("builder", ["wan", "h3"])
def test_reassigned_parameter_falls_back_exactly(builders, registry, builder: str) -> None:
    case = builders[builder]()
    attn_path = case.self_paths[0]
    session = install_diffusion_accelerations(case.model, {"optimized_mha": {}}, registry=registry)
    attn = case.model.get_submodule(attn_path)
    attn.to_v.weight = nn.Parameter(attn.to_v.weight.detach() * 0.5)
    reference = builders[builder]()
    reference.model.load_state_dict(case.model.state_dict())
    assert torch.equal(case.run(0), reference.run(0))
    record = _record(session)
    for p in ("to_q", "to_k", "to_v"):
        assert record["module_fallbacks"][f"{attn_path}.{p}"] == {"parameter_replaced": 1}
        assert f"{attn_path}.{p}" not in record["modules"]
    assert record["modules"][f"{case.self_paths[1]}.to_q"] == {"fused_qkv": 1}
    assert session.execution_report()["plugins"]["optimized_mha"]["model"]["added_weight_bytes"] > 0
    session.uninstall()


def test_hooks_added_after_install_run_through_the_members(wan_case, registry) -> None:
    dense = wan_case.run(0)
    session = install_diffusion_accelerations(wan_case.model, {"optimized_mha": {}}, registry=registry)
    seen: list[tuple[int, ...]] = []
    hook = wan_case.model.blocks[0].attn1.to_k.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    assert torch.equal(wan_case.run(0), dense)
    hook.remove()
    assert len(seen) == 1
    assert _record(session)["module_fallbacks"]["blocks.0.attn1.to_k"] == {"projection_hooks": 1}
    session.uninstall()


def test_a_non_bitwise_geometry_runs_the_members(wan_case, registry) -> None:
    dense = wan_case.run(0)
    session = install_diffusion_accelerations(wan_case.model, {"optimized_mha": {"self": {}}}, registry=registry)
    projection = wan_case.model.blocks[0].attn1.to_qkv
    projection._weight = projection._weight + 1e-3
    for _ in range(2):
        assert torch.equal(wan_case.run(0), dense)
    record = _record(session)
    assert record["module_fallbacks"]["blocks.0.attn1.to_q"] == {NOT_BITWISE: 2}
    assert record["counters"]["bitwise_mismatches"] in (1, 2)  # 2 when the CPU input alignment changed
    assert record["modules"]["blocks.1.attn1.to_q"] == {"fused_qkv": 2}
    session.uninstall()


def test_instance_fused_projections_false_is_restored(wan_case, registry) -> None:
    attn = wan_case.model.blocks[0].attn1
    wan_case.model.fuse_qkv_projections()
    wan_case.model.unfuse_qkv_projections()  # leaves fused_projections=False in the instance dict
    assert attn.__dict__["fused_projections"] is False
    session = install_diffusion_accelerations(wan_case.model, {"optimized_mha": {}}, registry=registry)
    assert attn.fused_projections is True
    session.uninstall()
    assert attn.__dict__["fused_projections"] is False and "to_qkv" not in attn.__dict__


@pytest.mark.parametrize("attribute", ["to_qkv", "to_kv"])
def test_refuses_modules_fused_by_the_user(wan_case, registry, attribute: str) -> None:
    attn = wan_case.model.blocks[1].attn1 if attribute == "to_qkv" else wan_case.model.blocks[1].attn2
    attn.add_module(attribute, nn.Linear(64, 128))  # what fuse_projections() leaves if fused_projections is reset
    path = f"blocks.1.attn{1 if attribute == 'to_qkv' else 2}.{attribute}"
    with pytest.raises(AccelerationRefusedError, match=rf"{path} exists: diffusers' fused projections"):
        install_diffusion_accelerations(wan_case.model, {"optimized_mha": {}}, registry=registry)
    assert "fused_projections" not in wan_case.model.blocks[0].attn1.__dict__
