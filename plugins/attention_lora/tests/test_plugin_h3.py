"""attention_lora on a tiny MiniMax-H3: install from a file, FP32 arithmetic, QKV reorder, restore, receipts."""

from __future__ import annotations

import hashlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from worldfoundry_attention_lora import apply_dit_attention_lora, prepare_attention_lora
from worldfoundry_attention_lora import handle as handle_module

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import AccelerationInstallError, ArtifactMismatchError

RANK = 4


def _registry() -> AccelerationRegistry:
    registry = AccelerationRegistry(discover=False)
    registry.register("attention_lora", prepare_attention_lora)
    return registry


def _reference(x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return base.double() + scale * (x.double() @ a.double().T) @ b.double().T


def test_entry_point_is_discovered() -> None:
    registry = AccelerationRegistry(discover=True, allowlist={"attention_lora"})
    assert "attention_lora" in registry.names()
    assert registry.get("attention_lora").distribution == "worldfoundry-attention-lora"


def test_install_from_file_receipts_and_exact_restore(h3, tools, tmp_path) -> None:
    adapter = tools.make_h3_adapter(h3, RANK, prefix="diffusion_model.", infix=".default")
    path = tmp_path / "attention-adapter.safetensors"
    save_file(adapter.state, str(path))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    inputs = tools.h3_inputs(h3)
    base_out = tools.run(h3, inputs)
    before = tools.state_snapshot(h3)
    signatures = {p: inspect.signature(h3.get_submodule(p).forward) for p in adapter.expected}

    spec = {"attention_lora": {"path": str(path), "rank": RANK, "scale": -1.0}}
    session = install_diffusion_accelerations(h3, spec, RuntimePolicy(), registry=_registry())
    record = session.receipt.plugins[0]
    assert record.options["sha256"] == digest and record.options["identity_kind"] == "file_sha256"
    assert (record.options["scope"], record.options["precision"]) == ("dit_only", "fp32")
    assert record.options["rank"] == RANK and record.options["scale"] == -1.0 and record.options["path"] == str(path)
    assert record.exact is False and any(digest in note for note in record.notes)
    assert set(record.claims) == set(adapter.expected) | {"role:attention_adapter"}
    assert session.receipt.execution_verified is False
    for p, sig in signatures.items():
        assert inspect.signature(h3.get_submodule(p).forward) == sig, p
    # the base weights are untouched while the adapter is active
    for k, v in h3.state_dict().items():
        assert torch.equal(v, before.state[k]), k

    guard = attach_request_guard(h3)
    with guard.request("r1"), request_scope(RequestContext("r1")):
        adapted = tools.run(h3, inputs)
    assert not torch.equal(adapted, base_out)
    report = session.execution_report()["plugins"]["attention_lora"]["model"]
    r1 = report["requests"]["r1"]
    assert set(r1["modules"]) == set(adapter.expected)
    assert all(kinds == {"fp32_adapter": 1} for kinds in r1["modules"].values())
    identity = r1["notes"]["attention_adapter"]
    assert identity["sha256"] == digest and identity["scope"] == "dit_only" and identity["precision"] == "fp32"
    assert identity["rank"] == RANK and identity["scale"] == -1.0 and identity["validated_only_modules"] == 4
    # per block: one shared Q/K/V down step + one output down step + four up steps, all on the CPU reference
    assert r1["counters"]["kernel_torch_reference"] == 6 * 2 and r1["counters"]["reference_fallback:cpu"] == 12
    assert report["kernels"]["fallback_reasons"] == {"cpu": 12} and report["adapter_device_copies"] == 0

    session.uninstall()
    tools.assert_snapshot_equal(before, tools.state_snapshot(h3))
    assert torch.equal(tools.run(h3, inputs), base_out)
    assert not hasattr(h3, "_worldfoundry_accelerations")


def test_scale_zero_is_bitwise_the_base_model(h3, tools) -> None:
    adapter = tools.make_h3_adapter(h3, RANK)
    inputs = tools.h3_inputs(h3)
    base_out = tools.run(h3, inputs)
    with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=0.0) as session:
        assert torch.equal(tools.run(h3, inputs), base_out)
        assert session.receipt.exact is True
        modules = session.execution_report()["plugins"]["attention_lora"]["model"]["requests"]["<no-request>"]["modules"]
        assert set(modules) == set(adapter.expected)
        assert all(kinds == {"scale_zero_identity": 1} for kinds in modules.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_arithmetic_matches_float64_reference(tools, dtype: torch.dtype) -> None:
    """Tolerances: FP32 model ≤ 2e-6 · max|y| (FP32 GEMM rounding); bf16 model: every element within half a
    bf16 ulp of the float64 value (plus FP32 noise), and ≥ 99% of elements are exactly the correctly rounded value."""
    model = tools.build_h3(seed=3).to(dtype)
    adapter = tools.make_h3_adapter(model, RANK, seed=5, magnitude=0.5)
    inputs = tools.h3_inputs(model, dtype=dtype)
    scale = -0.75
    with apply_dit_attention_lora(model, adapter.state, rank=RANK, scale=scale):
        recorder = tools.ProjectionRecorder(model, list(adapter.expected))
        tools.run(model, inputs)
        recorder.remove()
    exact = total = 0
    for path, calls in recorder.calls.items():
        assert len(calls) == 1, path
        x, y = calls[0]
        assert y.dtype == dtype
        module = model.get_submodule(path)
        base = F.linear(x, module.weight, module.bias)
        ref = _reference(x, base, *adapter.expected[path], scale)
        err = (y.double() - ref).abs()
        if dtype == torch.float32:
            assert err.max() <= 2e-6 * ref.abs().max(), path
        else:
            assert (err <= 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()).all(), path
            exact += int((y == ref.to(dtype)).sum())
            total += y.numel()
        assert (y != base).any(), path
    if dtype == torch.bfloat16:
        assert exact >= 0.99 * total


@pytest.mark.parametrize("only", ["q", "k", "v"])
def test_interleaved_rows_reach_the_right_projection(h3, tools, only: str) -> None:
    adapter = tools.make_h3_adapter(h3, RANK, only=only)
    paths = [f"transformer_blocks.{i}.attn.to_{n}" for i in range(2) for n in "qkv"]
    with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=1.0):
        recorder = tools.ProjectionRecorder(h3, paths)
        tools.run(h3, tools.h3_inputs(h3))
        recorder.remove()
    for path in paths:
        (x, y), = recorder.calls[path]
        module = h3.get_submodule(path)
        base = F.linear(x, module.weight, module.bias)
        if path.endswith(f"to_{only}"):
            assert not torch.equal(y, base), path
            assert torch.allclose(y.double(), _reference(x, base, *adapter.expected[path], 1.0), atol=1e-5)
        else:
            assert torch.equal(y, base), f"{path} changed although only the {only} rows are nonzero"


def test_invalid_adapter_attaches_nothing(h3, tools) -> None:
    adapter = tools.make_h3_adapter(h3, RANK)
    del adapter.state["blocks.0.attn.out_proj.lora_B.weight"]
    before = tools.state_snapshot(h3)
    with pytest.raises(ArtifactMismatchError, match="'blocks.0.attn.out_proj.lora_B.weight': missing"):
        with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0):
            pytest.fail("the body must not run")
    tools.assert_snapshot_equal(before, tools.state_snapshot(h3))
    assert not hasattr(h3, "_worldfoundry_accelerations")


def test_restore_after_exception_in_the_block(h3, tools) -> None:
    adapter = tools.make_h3_adapter(h3, RANK)
    inputs = tools.h3_inputs(h3)
    base_out = tools.run(h3, inputs)
    before = tools.state_snapshot(h3)
    bad = dict(inputs, hidden_states=inputs["hidden_states"][:, :, :5])  # the model raises inside a forward
    with pytest.raises(RuntimeError):
        with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0):
            tools.run(h3, inputs)
            tools.run(h3, bad)
    tools.assert_snapshot_equal(before, tools.state_snapshot(h3))
    assert torch.equal(tools.run(h3, inputs), base_out)
    with pytest.raises(KeyError):
        with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0):
            raise KeyError("user code failed")
    tools.assert_snapshot_equal(before, tools.state_snapshot(h3))


def test_restore_after_failure_during_activation(h3, tools, monkeypatch) -> None:
    adapter = tools.make_h3_adapter(h3, RANK)
    before = tools.state_snapshot(h3)
    real = handle_module._wrapper
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected failure while wrapping")
        return real(*args, **kwargs)

    monkeypatch.setattr(handle_module, "_wrapper", failing)
    with pytest.raises(AccelerationInstallError, match="injected failure") as info:
        with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0):
            pytest.fail("the body must not run")
    assert isinstance(info.value.__cause__, RuntimeError)
    tools.assert_snapshot_equal(before, tools.state_snapshot(h3))


def test_repeated_requests_and_reinstall(h3, tools) -> None:
    adapter = tools.make_h3_adapter(h3, RANK)
    inputs = tools.h3_inputs(h3)
    with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0):
        first = tools.run(h3, inputs)
        second = tools.run(h3, inputs)
    with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0):
        third = tools.run(h3, inputs)
    assert torch.equal(first, second) and torch.equal(first, third)


def test_path_can_be_given_to_the_context_manager(h3, tools, tmp_path) -> None:
    adapter = tools.make_h3_adapter(h3, RANK)
    path = tmp_path / "a.safetensors"
    save_file(adapter.state, str(path))
    inputs = tools.h3_inputs(h3)
    with apply_dit_attention_lora(h3, str(path), rank=RANK, scale=-1.0) as session:
        from_file = tools.run(h3, inputs)
        assert session.receipt.plugins[0].options["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    with apply_dit_attention_lora(h3, adapter.state, rank=RANK, scale=-1.0) as session:
        from_state = tools.run(h3, inputs)
        assert session.receipt.plugins[0].options["identity_kind"] == "state_dict_sha256"
    assert torch.equal(from_file, from_state)
