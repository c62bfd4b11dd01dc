"""``wan_block_fusion`` on tiny Wan models (CPU, Triton interpreter): bitwise to eager, receipts, exact restore,
visible fallbacks."""

from __future__ import annotations

import inspect

import pytest
import torch

from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.fusion.triton_support import REASON_DEVICE
from worldfoundry_block_fusion.eligibility import REASON_GRAD, REASON_TOKENS

pytestmark = pytest.mark.usefixtures("kernels")


@pytest.fixture(autouse=True)
def _helpers(kit) -> None:  # noqa: ANN001
    globals().update(kit=kit, build_wan=kit.build_wan, wan_inputs=kit.wan_inputs, run=kit.run, record_of=kit.record_of,
                     structure=kit.structure, assert_same_structure=kit.assert_same_structure,
                     make_registry=kit.make_registry)
ALL = {"modulate": 4, "gated_residual": 4, "cross_residual": 2, "rope": 2, "qk_norm": 2}


def install(model, options=None, **kwargs):
    return install_diffusion_accelerations(model, {"wan_block_fusion": options or {}}, registry=make_registry(),
                                           **kwargs)


#: the chains without ``layer_norm``, where ``float_carry`` hands the float32 stream to the torch LayerNorms
CARRY_CHAINS = ["modulate", "gated_residual", "cross_residual", "rope", "qk_norm", "float_carry"]


def test_bf16_forward_is_bitwise_and_every_chain_is_counted_per_block() -> None:
    model = build_wan()
    inputs = wan_inputs()
    dense = run(model, inputs)
    session = install(model, {"chains": CARRY_CHAINS})
    out = run(model, inputs, "r1")
    assert torch.equal(out, dense)
    record = record_of(session, "r1")
    assert record["fallbacks"] == {} and record["claimed_not_executed"] == []
    for chain, n in ALL.items():
        assert record["counters"][chain] == n, chain
    # the float32 stream is carried into norm2 and norm3 of each block and into the next block's norm1
    assert record["counters"]["float_carry"] == 5
    assert record["modules"]["blocks.0"] == {"modulate": 2, "gated_residual": 2, "cross_residual": 1, "rope": 1,
                                             "float_carry": 2, "qk_norm": 1}
    assert record["modules"]["blocks.1"]["float_carry"] == 3  # and blocks.0's output stream into its norm1
    assert session.receipt.to_json()["plugins"][0]["exact"] is True
    session.uninstall()


def test_uninstall_restores_exactly_and_signatures_are_kept() -> None:
    model = build_wan()
    inputs = wan_inputs()
    before = structure(model)
    dense = run(model, inputs)
    signature = inspect.signature(model.blocks[0].forward)
    session = install(model)
    assert inspect.signature(model.blocks[0].forward) == signature
    assert type(model.blocks[0].attn1.processor).__name__ == "WanFusedSelfAttnProcessor"
    run(model, inputs, "r1")
    session.uninstall()
    session.uninstall()  # idempotent
    assert_same_structure(before, structure(model))
    assert torch.equal(run(model, inputs), dense)


@pytest.mark.parametrize("chains", [["modulate"], ["gated_residual"], ["cross_residual", "float_carry"], ["rope"],
                                    ["modulate", "rope"], ["rope", "qk_norm"]])
def test_each_chain_alone_is_bitwise(chains: list[str]) -> None:
    model = build_wan(num_layers=1)
    inputs = wan_inputs()
    dense = run(model, inputs)
    session = install(model, {"chains": chains})
    assert torch.equal(run(model, inputs, "r1"), dense)
    counters = record_of(session, "r1")["counters"]
    assert {c for c in counters if counters[c]} == set(chains)
    session.uninstall()


def test_float32_model_and_selected_blocks() -> None:
    model = build_wan(torch.float32)
    inputs = wan_inputs(torch.float32)
    dense = run(model, inputs)
    session = install(model, {"blocks": [1]})
    assert torch.equal(run(model, inputs, "r1"), dense)
    record = record_of(session, "r1")
    assert set(record["modules"]) == {"blocks.1"} and "float_carry" not in record["counters"]
    assert session.receipt.to_json()["plugins"][0]["claims"] == ["blocks.1"]
    session.uninstall()


def test_i2v_and_per_token_timesteps_are_bitwise() -> None:
    """Wan I2V (image K/V in cross-attention) and Wan 2.2 TI2V's per-token timestep ([B, S, 6, C] modulation)."""
    model = build_wan(image_dim=32, added_kv_proj_dim=64)
    inputs = wan_inputs(text_tokens=512, image_tokens=4)
    dense = run(model, inputs)
    session = install(model)
    assert torch.equal(run(model, inputs, "r1"), dense)
    session.uninstall()
    model = build_wan(num_layers=1)
    per_token = wan_inputs(timestep=torch.linspace(100, 900, 32).round().long()[None])  # 32 tokens
    dense = run(model, per_token)
    session = install(model)
    assert torch.equal(run(model, per_token, "r2"), dense)
    assert record_of(session, "r2")["counters"]["modulate"] == 2
    session.uninstall()


def test_cpu_without_the_interpreter_falls_back_visibly(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_wan(num_layers=1, device="cpu")
    inputs = wan_inputs(device="cpu")
    dense = run(model, inputs)
    session = install(model)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert torch.equal(run(model, inputs, "r1"), dense)
    record = record_of(session, "r1")
    assert record["module_fallbacks"]["blocks.0"] == {REASON_DEVICE: 1, f"rope: {REASON_DEVICE}": 1,
                                                      f"qk_norm: {REASON_DEVICE}": 1}
    assert record["claimed_not_executed"] == ["blocks.0"]
    session.uninstall()


def test_grad_mode_and_min_tokens_fall_back() -> None:
    model = build_wan(num_layers=1)
    inputs = wan_inputs()
    dense = run(model, inputs)
    session = install(model, {"min_tokens": 33})  # 32 tokens per sample
    assert torch.equal(run(model, inputs, "r1"), dense)
    assert record_of(session, "r1")["module_fallbacks"]["blocks.0"] == {
        REASON_TOKENS: 1, f"rope: {REASON_TOKENS}": 1, f"qk_norm: {REASON_TOKENS}": 1}
    session.uninstall()
    session = install(model)
    out = model(**inputs)[0]  # grad mode on: the kernels are inference-only
    assert torch.equal(out.detach(), dense)
    reasons = record_of(session, "<no-request>")["module_fallbacks"]["blocks.0"]
    assert reasons == {REASON_GRAD: 1, f"rope: {REASON_GRAD}": 1, f"qk_norm: {REASON_GRAD}": 1}
    session.uninstall()


def test_a_hook_added_after_install_still_runs_and_stays_bitwise() -> None:
    """The float32 carry is not used across a hook that could change the stream between blocks."""
    model = build_wan()
    inputs = wan_inputs()
    session = install(model, {"chains": CARRY_CHAINS})
    seen = []
    handle = model.blocks[0].register_forward_hook(lambda m, a, out: seen.append(out.shape) or out * 2)
    try:
        out = run(model, inputs, "r1")
    finally:
        handle.remove()
    session.uninstall()
    handle = model.blocks[0].register_forward_hook(lambda m, a, out: out * 2)
    dense = run(model, inputs)
    handle.remove()
    assert seen and torch.equal(out, dense)
    assert record_of(session, "r1")["counters"]["float_carry"] == 4


def test_precompile_covers_every_kernel_variant_the_first_forward_launches(monkeypatch) -> None:  # noqa: ANN001
    from worldfoundry.core.fusion import adaln, qk_norm_rope, rope
    from worldfoundry_block_fusion.wan_block import WanBlockRuntime

    model = build_wan()
    inputs = wan_inputs()
    dense = run(model, inputs)
    session = install(model)
    seen: list[set] = []
    original = WanBlockRuntime.precompile

    def spy(self, *args):  # noqa: ANN001, ANN202
        original(self, *args)
        seen.append(plans())

    def plans() -> set:
        return set(adaln._PLANS) | set(rope._PLANS) | set(qk_norm_rope._PLANS)

    monkeypatch.setattr(WanBlockRuntime, "precompile", spy)
    for module in (adaln, rope, qk_norm_rope):
        module._PLANS.clear()
    out = run(model, inputs, "r1")
    assert torch.equal(out, dense)
    assert len(seen) == 1  # once per model, at its first fused block
    # modulate, gated residual (+ float32 carry), cross residual, Q/K norms + rotary: no plan appears afterwards
    assert len(seen[0]) == 4 and plans() == seen[0]
    assert len(qk_norm_rope._PLANS) == 1 and not rope._PLANS
    record = record_of(session, "r1")
    for chain, n in ALL.items():  # precompilation counts nothing
        assert record["counters"][chain] == n, chain
    session.uninstall()


def test_modulation_check_is_remembered_per_block_and_per_forward_and_equals_the_full_check() -> None:
    from worldfoundry.plugin import ExecutionLedger
    from worldfoundry_block_fusion.eligibility import modulation_reason
    from worldfoundry_block_fusion.handle import FusionCounters
    from worldfoundry_block_fusion.wan_block import WanBlockRuntime

    runtime = WanBlockRuntime(FusionCounters(ExecutionLedger("wan_block_fusion")), ("modulate",), 0, [])
    x = torch.randn(2, 8, 64)
    tables = [torch.randn(1, 6, 64), torch.randn(1, 6, 32), torch.randn(1, 6, 64).to(torch.int32)]
    tembs = [torch.randn(2, 6, 64), torch.randn(2, 6, 32), torch.randn(3, 6, 64), torch.randn(2, 8, 6, 64),
             torch.randn(2, 1, 6, 64), torch.randn(2, 5, 6, 64)]
    checked = [None, None, None]
    for _ in range(2):  # the second round finds the remembered checks
        for table in tables:
            for temb in tembs:
                for stream in (x, x[:, :5]):
                    expected = modulation_reason(stream, table[0], temb)
                    assert runtime.modulation_reason(stream, table, temb, checked) == expected
    assert runtime.modulation_reason(x, tables[0], tembs[0], checked) is None
    assert checked[0] is tables[0] and runtime.temb_checked[0] is tembs[0]


LN_CHAINS = ["modulate", "gated_residual", "cross_residual", "rope", "layer_norm"]


@pytest.fixture
def cuda_layer_norm_on_cpu() -> None:
    """The ``kernels`` fixture already computes eager's LayerNorm with PyTorch's CUDA algorithm on the CPU."""


def test_layer_norm_chain_is_bitwise_and_counted(cuda_layer_norm_on_cpu: None) -> None:
    model = build_wan()
    inputs = wan_inputs()
    dense = run(model, inputs)
    session = install(model, {"chains": LN_CHAINS})
    out = run(model, inputs, "r1")
    assert torch.equal(out, dense)
    record = record_of(session, "r1")
    assert record["fallbacks"] == {}
    # norm1, norm2 and norm3 of both blocks; no float32 stream is carried beside it
    assert record["counters"]["layer_norm"] == 6 and record["counters"]["modulate"] == 4
    assert record["counters"].get("float_carry", 0) == 0
    session.uninstall()
    assert torch.equal(run(model, inputs), dense)


def test_layer_norm_chain_without_modulate_fuses_norm2_only(cuda_layer_norm_on_cpu: None) -> None:
    model = build_wan(num_layers=1)
    inputs = wan_inputs()
    dense = run(model, inputs)
    session = install(model, {"chains": ["layer_norm", "gated_residual"]})
    assert torch.equal(run(model, inputs, "r1"), dense)
    assert record_of(session, "r1")["counters"]["layer_norm"] == 1
    session.uninstall()


def test_layer_norm_chain_falls_back_on_the_cpu(kernels: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    from worldfoundry_block_fusion import eligibility

    if kernels.type != "cpu":
        pytest.skip("CUDA tensors take the fused LayerNorm here; the CPU refusal needs the kernels on CPU tensors "
                    "(Triton's interpreter)")
    import torch.nn.functional as F  # noqa: N812

    monkeypatch.setattr(F, "layer_norm", kit.TORCH_LAYER_NORM)  # PyTorch's own CPU LayerNorm, as a user runs it
    monkeypatch.setattr(eligibility, "NORM_DEVICES", ("cuda",))
    model = build_wan(num_layers=1)
    inputs = wan_inputs()
    dense = run(model, inputs)
    session = install(model, {"chains": LN_CHAINS})
    assert torch.equal(run(model, inputs, "r1"), dense)  # PyTorch's CPU LayerNorm is another algorithm
    record = record_of(session, "r1")
    assert record["fallbacks"] == {eligibility.REASON_NORM_DEVICE: 3} and record["modules"]["blocks.0"]["modulate"] == 2
    session.uninstall()


def test_layer_norm_chain_runs_a_hooked_norm_as_its_module(cuda_layer_norm_on_cpu: None) -> None:
    model = build_wan(num_layers=1)
    inputs = wan_inputs()
    session = install(model, {"chains": LN_CHAINS})
    seen = []
    handle = model.blocks[0].norm3.register_forward_hook(lambda m, a, out: seen.append(1))
    try:
        out = run(model, inputs, "r2")
    finally:
        handle.remove()
    record = record_of(session, "r2")
    assert seen == [1] and record["counters"]["layer_norm"] == 2
    assert record["fallbacks"] == {"layer_norm: the norm module is wrapped or hooked (it runs as a module)": 1}
    session.uninstall()
    assert torch.equal(out, run(model, inputs))  # eager, with the same (reference) LayerNorm


def test_precompile_covers_the_layer_norm_variants(cuda_layer_norm_on_cpu: None, monkeypatch) -> None:  # noqa: ANN001
    from worldfoundry.core.fusion import adaln, layer_norm, rope
    from worldfoundry_block_fusion.wan_block import WanBlockRuntime

    model = build_wan()
    inputs = wan_inputs()
    session = install(model, {"chains": LN_CHAINS})
    seen: list[set] = []
    original = WanBlockRuntime.precompile

    def spy(self, *args):  # noqa: ANN001, ANN202
        original(self, *args)
        seen.append(set(adaln._PLANS) | set(rope._PLANS) | set(layer_norm._PLANS))

    monkeypatch.setattr(WanBlockRuntime, "precompile", spy)
    for plans in (adaln._PLANS, rope._PLANS, layer_norm._PLANS):
        plans.clear()
    run(model, inputs, "r1")
    # gated residual, cross residual, rotary, LayerNorm + modulation, LayerNorm + affine + cast, and the modulate
    # kernel a norm that falls back would use
    assert len(seen) == 1 and len(seen[0]) == 6
    assert set(adaln._PLANS) | set(rope._PLANS) | set(layer_norm._PLANS) == seen[0]
    session.uninstall()


def test_layer_norm_chain_rechecks_a_norm_whose_parameters_change(cuda_layer_norm_on_cpu: None) -> None:
    model = build_wan(num_layers=1)
    inputs = wan_inputs()
    session = install(model, {"chains": LN_CHAINS})
    run(model, inputs, "r1")
    assert record_of(session, "r1")["counters"]["layer_norm"] == 3
    norm2 = model.blocks[0].norm2
    original = norm2.weight
    misaligned = torch.nn.Parameter(
        torch.empty(original.numel() + 1, dtype=original.dtype, device=original.device)[1:].copy_(original))
    norm2.weight = misaligned  # float32 and 4 bytes past an aligned address: PyTorch takes another kernel
    try:
        dense = run(model, inputs)
        out = run(model, inputs, "r2")
    finally:
        norm2.weight = original
    record = record_of(session, "r2")
    assert original.dtype == torch.float32  # diffusers keeps the norms in float32
    assert record["counters"]["layer_norm"] == 2
    assert record["fallbacks"] == {"layer_norm: float32 weight or bias not contiguous and 16-byte aligned": 1}
    assert torch.equal(out, dense)
    session.uninstall()
