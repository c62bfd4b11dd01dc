"""The ``glu`` chain of ``sana_block_fusion``: the fused ``GLUMBTempConv`` forward, receipts, refusals, restore.

On the CPU the chain falls back (the kernel's exactness is CUDA's expf); these tests add ``"cpu"`` to
``sana_ffn.KERNEL_DEVICES`` to run the fused path in Triton's interpreter, and compare it

* with the kernel replaced by eager's own ``h * silu(g)``: the reproduced feed-forward is bitwise eager's;
* with the interpreted kernel against the same forward computed by the kernel's reference formula with the
  interpreter's (numpy) ``exp``: bitwise; and against eager within a stated tolerance (numpy's ``exp`` is not
  torch's CPU ``exp``).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.fusion import glu
from worldfoundry.errors import AccelerationRefusedError
from worldfoundry_block_fusion import sana_ffn

pytestmark = pytest.mark.usefixtures("kernels")
NAME = "sana_block_fusion"
BLOCKS = ("transformer_blocks.0", "transformer_blocks.1")


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the glu kernel take CPU tensors (Triton's interpreter)."""
    monkeypatch.setattr(sana_ffn, "KERNEL_DEVICES", ["cuda", "cpu"])


def _numpy_formula(h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    exp = (lambda t: torch.from_numpy(np.exp(t.numpy()))) if h.device.type == "cpu" else torch.exp
    return glu.reference_silu_gate_formula(h, g, exp)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_feed_forward_reproduces_eager_bitwise(kit: Any, monkeypatch: Any, dtype: torch.dtype) -> None:
    model = kit.build_sana(dtype)
    inputs = kit.sana_inputs(dtype)
    before = kit.structure(model)
    dense = kit.run(model, inputs)
    ff = model.transformer_blocks[0].ff
    signature = inspect.signature(ff.forward)
    monkeypatch.setattr(sana_ffn, "silu_gate", glu.reference_silu_gate)  # eager's product inside the fused forward
    session = install_diffusion_accelerations(model, {NAME: {"chains": ["glu"]}}, registry=kit.make_registry())
    assert "forward" in vars(ff) and inspect.signature(ff.forward) == signature
    assert torch.equal(kit.run(model, inputs, "r1"), dense)
    record = kit.record_of(session, "r1", NAME)
    assert record["counters"]["glu"] == 2 and record["fallbacks"] == {}
    assert record["claimed_not_executed"] == []
    session.uninstall()
    assert "forward" not in vars(ff)
    kit.assert_same_structure(before, kit.structure(model))
    assert torch.equal(kit.run(model, inputs), dense)


@pytest.mark.usefixtures("on_cpu")
def test_interpreted_kernel_in_the_model(kit: Any, monkeypatch: Any) -> None:
    model = kit.build_sana()
    inputs = kit.sana_inputs()
    dense = kit.run(model, inputs)
    session = install_diffusion_accelerations(model, {NAME: {}}, registry=kit.make_registry())
    fused = kit.run(model, inputs, "r1")
    counters = kit.record_of(session, "r1", NAME)["counters"]
    assert counters["glu"] == 2 and counters["linear_attention"] == 2
    monkeypatch.setattr(sana_ffn, "silu_gate", _numpy_formula)
    assert torch.equal(kit.run(model, inputs, "r2"), fused)  # the kernel is its formula, bitwise
    session.uninstall()
    # numpy's float32 exp differs from torch's CPU exp in the last bit of some values (stated tolerance)
    assert (fused.float() - dense.float()).abs().max().item() <= 0.05 * dense.float().abs().max().item()


def test_cpu_falls_back_visibly_and_other_reasons(kit: Any) -> None:
    model = kit.build_sana()
    inputs = kit.sana_inputs()
    dense = kit.run(model, inputs)
    session = install_diffusion_accelerations(model, {NAME: {"chains": ["glu"]}}, registry=kit.make_registry())
    assert torch.equal(kit.run(model, inputs, "r1"), dense)
    record = kit.record_of(session, "r1", NAME)
    if dense.device.type == "cpu":
        assert record["module_fallbacks"] == {p: {"glu: " + sana_ffn.REASON_CPU: 1} for p in BLOCKS}
    else:
        assert record["counters"]["glu"] == 2
    session.uninstall()


@pytest.mark.usefixtures("on_cpu")
def test_runtime_fallbacks_are_counted_with_reasons(kit: Any) -> None:
    model = kit.build_sana()
    inputs = kit.sana_inputs()
    dense = kit.run(model, inputs)
    reg = kit.make_registry()
    session = install_diffusion_accelerations(model, {NAME: {"chains": ["glu"], "min_tokens": 10_000}},
                                              registry=reg)
    assert torch.equal(kit.run(model, inputs, "r1"), dense)
    reasons = kit.record_of(session, "r1", NAME)["module_fallbacks"]
    assert all(f"glu: {sana_ffn.REASON_TOKENS}" in reasons[p] for p in BLOCKS)
    session.uninstall()

    session = install_diffusion_accelerations(model, {NAME: {"chains": ["glu"]}}, registry=reg)
    handle = model.transformer_blocks[1].ff.nonlinearity.register_forward_hook(lambda m, a, o: None)
    assert torch.equal(kit.run(model, inputs, "r2"), dense)
    record = kit.record_of(session, "r2", NAME)
    assert record["counters"]["glu"] == 1
    assert record["module_fallbacks"] == {"transformer_blocks.1": {"glu: " + sana_ffn.REASON_HOOKS: 1}}
    handle.remove()
    with request_scope(RequestContext("r3")):  # grad mode: the original forward, counted
        assert torch.equal(model(**inputs)[0].detach(), dense)
    reasons = kit.record_of(session, "r3", NAME)["module_fallbacks"]
    assert all(f"glu: {sana_ffn.REASON_GRAD}" in reasons[p] for p in BLOCKS)
    session.uninstall()


def test_prepare_refuses_feed_forwards_it_cannot_reproduce(kit: Any) -> None:
    reg = kit.make_registry()
    model = kit.build_sana()
    model.transformer_blocks[1].ff.register_forward_pre_hook(lambda m, a: None)
    with pytest.raises(AccelerationRefusedError, match="transformer_blocks.1.ff has forward hooks"):
        install_diffusion_accelerations(model, {NAME: {}}, registry=reg)
    install_diffusion_accelerations(model, {NAME: {"chains": ["modulate"]}}, registry=reg).uninstall()

    model = kit.build_sana()
    model.transformer_blocks[0].ff.nonlinearity = nn.GELU()
    with pytest.raises(AccelerationRefusedError, match="nonlinearity is a GELU"):
        install_diffusion_accelerations(model, {NAME: {"chains": ["glu"]}}, registry=reg)

    model = kit.build_sana()
    ff = model.transformer_blocks[0].ff
    ff.forward = ff.forward
    with pytest.raises(AccelerationRefusedError, match="ff.forward is already replaced"):
        install_diffusion_accelerations(model, {NAME: {"chains": ["glu"]}}, registry=reg)
    del ff.forward
    assert [m for m in model.modules() if "forward" in vars(m)] == []


@pytest.mark.usefixtures("on_cpu")
def test_precompile_records_the_glu_variant_the_first_forward_launches(kit: Any, monkeypatch: Any) -> None:
    from worldfoundry_block_fusion.sana_block import SanaBlockRuntime

    model = kit.build_sana()
    inputs = kit.sana_inputs()
    session = install_diffusion_accelerations(model, {NAME: {"chains": ["glu"]}}, registry=kit.make_registry())
    seen: list[set] = []
    original = SanaBlockRuntime.precompile

    def spy(self: Any, *args: Any) -> None:
        original(self, *args)
        seen.append(set(glu._PLANS))

    monkeypatch.setattr(SanaBlockRuntime, "precompile", spy)
    glu._PLANS.clear()
    kit.run(model, inputs, "r1")
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0] == set(glu._PLANS)
    assert kit.record_of(session, "r1", NAME)["counters"]["glu"] == 2  # precompilation counts nothing
    session.uninstall()


def test_options_name_the_glu_chain() -> None:
    from worldfoundry.errors import AccelerationOptionsError
    from worldfoundry_block_fusion.options import SANA_CHAINS, SanaOptions, WanOptions

    assert "glu" in SANA_CHAINS and SanaOptions.from_mapping({}).chains == SANA_CHAINS
    assert SanaOptions.from_mapping({"chains": ["glu"]}).chains == ("glu",)
    with pytest.raises(AccelerationOptionsError, match="chains\\[0\\]"):
        WanOptions.from_mapping({"chains": ["glu"]})
