"""attention_lora on a tiny Wan (diffusers/PEFT naming): self- and cross-attention, partial adapters, restore."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from worldfoundry_attention_lora import apply_dit_attention_lora, make_prepare
from worldfoundry_attention_lora.source import state_dict_source

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import AccelerationRefusedError

RANK = 4


def test_wan_adapter_arithmetic_and_restore(wan, tools) -> None:
    """Tolerance (FP32 model): max |y − y₆₄| ≤ 2e-6 · max |y₆₄| per projection."""
    adapter = tools.make_wan_adapter(wan, RANK, prefix="transformer.", infix=".default", magnitude=0.5)
    inputs = tools.wan_inputs()
    base_out = tools.run(wan, inputs)
    before = tools.state_snapshot(wan)
    with apply_dit_attention_lora(wan, adapter.state, rank=RANK, scale=0.5) as session:
        recorder = tools.ProjectionRecorder(wan, list(adapter.expected))
        with request_scope(RequestContext("w1")):
            adapted = tools.run(wan, inputs)
        recorder.remove()
        report = session.execution_report()["plugins"]["attention_lora"]["model"]["requests"]["w1"]
    assert not torch.equal(adapted, base_out)
    for path, calls in recorder.calls.items():
        (x, y), = calls
        module = wan.get_submodule(path)
        base = F.linear(x, module.weight, module.bias)
        a, b = adapter.expected[path]
        ref = base.double() + 0.5 * (x.double() @ a.double().T) @ b.double().T
        assert (y.double() - ref).abs().max() <= 2e-6 * ref.abs().max(), path
    assert set(report["modules"]) == set(adapter.expected)
    # per block: attn1 Q/K/V share one down step, attn2 has Q alone and K/V together, plus two output projections:
    # 5 down + 8 up steps
    assert report["counters"]["kernel_torch_reference"] == 13 * 2
    tools.assert_snapshot_equal(before, tools.state_snapshot(wan))
    assert torch.equal(tools.run(wan, inputs), base_out)


def test_partial_wan_adapter_changes_only_its_projections(wan, tools) -> None:
    adapter = tools.make_wan_adapter(wan, RANK, projections=("to_k", "to_out.0"), attentions=("attn2",))
    all_paths = [f"blocks.{i}.{a}.{p}" for i in range(2) for a in ("attn1", "attn2")
                 for p in ("to_q", "to_k", "to_v", "to_out.0")]
    with apply_dit_attention_lora(wan, adapter.state, rank=RANK, scale=-1.0) as session:
        recorder = tools.ProjectionRecorder(wan, all_paths)
        tools.run(wan, tools.wan_inputs())
        recorder.remove()
        claims = set(session.receipt.plugins[0].claims)
    assert claims == set(adapter.expected) | {"role:attention_adapter"}
    for path in all_paths:
        (x, y), = recorder.calls[path]
        module = wan.get_submodule(path)
        changed = not torch.equal(y, F.linear(x, module.weight, module.bias))
        assert changed == (path in adapter.expected), path


def test_wan_bf16_scale_zero_is_bitwise(tools) -> None:
    model = tools.build_wan(seed=4).to(torch.bfloat16)
    inputs = tools.wan_inputs(dtype=torch.bfloat16)
    base_out = tools.run(model, inputs)
    with apply_dit_attention_lora(model, tools.make_wan_adapter(model, RANK).state, rank=RANK, scale=0.0):
        assert torch.equal(tools.run(model, inputs), base_out)
    assert torch.equal(tools.run(model, inputs), base_out)


def test_routed_experts_share_one_session(tools) -> None:
    """Given ``{"high": m1, "low": m2}`` the same adapter is validated and applied on each expert."""
    high, low = tools.build_wan(seed=1), tools.build_wan(seed=2)
    adapter = tools.make_wan_adapter(high, RANK)
    registry = AccelerationRegistry(discover=False)
    registry.register("attention_lora", make_prepare(state_dict_source(adapter.state)))
    inputs = tools.wan_inputs()
    base = {k: tools.run(m, inputs) for k, m in (("high", high), ("low", low))}
    session = install_diffusion_accelerations({"high": high, "low": low},
                                              {"attention_lora": {"rank": RANK, "scale": -1.0}}, RuntimePolicy(),
                                              registry=registry)
    assert session.receipt.plugins[0].experts == ("high", "low")
    assert not torch.equal(tools.run(high, inputs), base["high"])
    assert not torch.equal(tools.run(low, inputs), base["low"])
    session.uninstall()
    assert torch.equal(tools.run(high, inputs), base["high"]) and torch.equal(tools.run(low, inputs), base["low"])


def test_cuda_device_policy_without_cuda_is_visible(wan, tools) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    adapter = tools.make_wan_adapter(wan, RANK)
    with pytest.raises(AccelerationRefusedError, match="CUDA is not available"):
        with apply_dit_attention_lora(wan, adapter.state, rank=RANK, scale=-1.0,
                                      policy=RuntimePolicy(device="cuda")):
            pytest.fail("the body must not run")
    assert not hasattr(wan, "_worldfoundry_accelerations")
