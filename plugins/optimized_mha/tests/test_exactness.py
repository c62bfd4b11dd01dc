"""Fusion is bitwise equal to the dense model, adds no weight memory and restores exactly (every family)."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from worldfoundry.core.acceleration.installer import install_diffusion_accelerations


def storages(model: nn.Module) -> dict[int, int]:
    """Storage data pointer -> bytes of every parameter (a shared storage counted once)."""
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}


def _fused_paths(case) -> list[str]:  # noqa: ANN001
    paths = [f"{a}.{p}" for a in case.self_paths for p in ("to_q", "to_k", "to_v")]
    paths += [f"{a}.{p}" for a in case.cross_paths for p in ("to_k", "to_v")]
    if case.name == "wan-i2v":
        paths += [f"{a}.{p}" for a in case.cross_paths for p in ("add_k_proj", "add_v_proj")]
    return sorted(paths)


def _storages_saved(case) -> int:  # noqa: ANN001
    """Each packed group of n projections turns n weight (and n bias) storages into one."""
    saved = 0
    for attn in case.self_paths:
        saved += 2 * (1 + (case.model.get_submodule(attn).to_q.bias is not None))
    for attn in case.cross_paths:
        groups = 2 if case.name == "wan-i2v" else 1
        saved += groups * (1 + (case.model.get_submodule(attn).to_k.bias is not None))
    return saved


def test_outputs_state_dict_and_memory(case, registry) -> None:  # noqa: ANN001
    model = case.model
    dense = [case.run(seed) for seed in (0, 1)]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    before = storages(model)
    signatures = {p: inspect.signature(model.get_submodule(p).forward) for p in _fused_paths(case)}

    session = install_diffusion_accelerations(model, {"optimized_mha": {}}, registry=registry)
    installed = storages(model)
    assert sum(installed.values()) == sum(before.values())  # no weight memory added
    assert len(before) - len(installed) == _storages_saved(case)
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p is params[n] for n, p in model.named_parameters())
    assert {p: inspect.signature(model.get_submodule(p).forward) for p in signatures} == signatures

    assert all(torch.equal(case.run(seed), dense[seed]) for seed in (0, 1))

    plugin = session.receipt.plugins[0]
    assert plugin.exact is True
    assert sorted(plugin.claims) == _fused_paths(case)
    report = session.execution_report()["plugins"]["optimized_mha"]["model"]
    modules = report["requests"]["<no-request>"]["modules"]
    fallbacks = report["requests"]["<no-request>"]["module_fallbacks"]
    for path in _fused_paths(case):
        done = sum(modules.get(path, {}).values()) + sum(fallbacks.get(path, {}).values())
        assert done == 2, path  # two forwards, each projection accounted for once per forward
    assert report["added_weight_bytes"] == 0
    assert all(g["shares_storage"] for g in report["packed_groups"].values())

    session.uninstall()
    after = storages(model)
    assert len(after) == len(before) and sum(after.values()) == sum(before.values())
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all("forward" not in model.get_submodule(p).__dict__ for p in signatures)
    assert torch.equal(case.run(0), dense[0])


def test_checkpoint_saved_while_installed_is_canonical(wan_case, registry, tmp_path) -> None:  # noqa: ANN001
    from safetensors.torch import load_file, save_file

    save_file(wan_case.model.state_dict(), tmp_path / "dense.safetensors")
    session = install_diffusion_accelerations(wan_case.model, {"optimized_mha": {}}, registry=registry)
    save_file(wan_case.model.state_dict(), tmp_path / "installed.safetensors")
    session.uninstall()
    dense, installed = load_file(tmp_path / "dense.safetensors"), load_file(tmp_path / "installed.safetensors")
    assert list(dense) == list(installed) and all(torch.equal(dense[k], installed[k]) for k in dense)
    assert (tmp_path / "dense.safetensors").stat().st_size == (tmp_path / "installed.safetensors").stat().st_size


def test_receipts_count_fused_calls_per_module(wan_case, registry) -> None:  # noqa: ANN001
    session = install_diffusion_accelerations(wan_case.model, {"optimized_mha": {"self": {"fusion": "qkv"}}},
                                              registry=registry)
    for seed in range(3):
        wan_case.run(seed)
    record = session.execution_report()["plugins"]["optimized_mha"]["model"]["requests"]["<no-request>"]
    assert set(record["modules"]) == {f"blocks.{i}.attn1.{p}" for i in (0, 1) for p in ("to_q", "to_k", "to_v")}
    assert all(v == {"fused_qkv": 3} for v in record["modules"].values())
    assert record["counters"]["fused_qkv"] == 18 and record["fallbacks"] == {}
    assert record["counters"]["bitwise_checks"] >= 2
    assert record["claimed_not_executed"] == []
    assert sorted(session.receipt.plugins[0].claims) == sorted(record["modules"])
    session.uninstall()


def test_in_place_weight_loads_keep_the_fused_path(wan_case, registry, builders) -> None:  # noqa: ANN001
    model = wan_case.model
    new_state = {k: v + 0.01 for k, v in model.state_dict().items()}
    reference = builders["wan"]()
    reference.model.load_state_dict(new_state)
    session = install_diffusion_accelerations(model, {"optimized_mha": {}}, registry=registry)
    model.load_state_dict(new_state)  # copies into the packed storage
    assert torch.equal(wan_case.run(0), reference.run(0))
    record = session.execution_report()["plugins"]["optimized_mha"]["model"]["requests"]["<no-request>"]
    assert record["counters"].get("dense_fallback", 0) == 0
    session.uninstall()


def test_replaced_parameter_runs_dense_and_stays_exact(wan_case, registry, builders) -> None:  # noqa: ANN001
    model = wan_case.model
    session = install_diffusion_accelerations(model, {"optimized_mha": {}}, registry=registry)
    new_weight = nn.Parameter(model.blocks[0].attn1.to_k.weight.detach() * 1.5)
    model.blocks[0].attn1.to_k.weight = new_weight
    reference = builders["wan"]()
    reference.model.load_state_dict(model.state_dict())
    out = wan_case.run(0)
    assert torch.equal(out, reference.run(0))
    record = session.execution_report()["plugins"]["optimized_mha"]["model"]["requests"]["<no-request>"]
    assert record["module_fallbacks"]["blocks.0.attn1.to_k"] == {"parameter_replaced": 1}
    assert record["modules"]["blocks.1.attn1.to_k"] == {"fused_qkv": 1}
    session.uninstall()  # the user's Parameter stays; the others get their own storage back
    assert model.blocks[0].attn1.to_k.weight is new_weight
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == len(list(model.parameters()))
