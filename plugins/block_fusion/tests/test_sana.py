"""``sana_block_fusion`` on a tiny SANA-Video model (CPU, Triton interpreter): bitwise, receipts, exact restore."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worldfoundry.core.acceleration.installer import install_diffusion_accelerations

pytestmark = pytest.mark.usefixtures("kernels")
NAME = "sana_block_fusion"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_is_bitwise_and_counted(kit: Any, dtype: torch.dtype) -> None:
    model = kit.build_sana(dtype)
    inputs = kit.sana_inputs(dtype)
    before = kit.structure(model)
    dense = kit.run(model, inputs)
    session = install_diffusion_accelerations(model, {NAME: {}}, registry=kit.make_registry())
    assert type(model.transformer_blocks[0].attn1.processor).__name__ == "SanaFusedLinearAttnProcessor"
    out = kit.run(model, inputs, "r1")
    assert torch.equal(out, dense)
    record = kit.record_of(session, "r1", NAME)
    assert record["counters"]["modulate"] == 4 and record["counters"]["linear_attention"] == 2
    assert record["counters"]["cross_residual"] == 2
    # the first block receives the patch embedding's transposed view: its first residual runs eager, counted
    assert record["counters"]["gated_residual"] == 3
    expected = {"transformer_blocks.0": {"gated_residual: non-contiguous residual stream": 1}}
    if out.device.type == "cuda":
        assert record["counters"]["glu"] == 2
    else:  # the glu kernel's exactness is CUDA's: on the CPU it falls back, visibly (test_sana_glu forces it)
        from worldfoundry_block_fusion.sana_ffn import REASON_CPU

        assert "glu" not in record["counters"]
        for path in ("transformer_blocks.0", "transformer_blocks.1"):
            expected.setdefault(path, {})["glu: " + REASON_CPU] = 1
    assert record["module_fallbacks"] == expected
    assert record["claimed_not_executed"] == []
    session.uninstall()
    kit.assert_same_structure(before, kit.structure(model))
    assert torch.equal(kit.run(model, inputs), dense)


@pytest.mark.parametrize("chains", [["modulate"], ["linear_attention"], ["gated_residual", "cross_residual"]])
def test_chain_subsets_are_bitwise(kit: Any, chains: list[str]) -> None:
    model = kit.build_sana()
    inputs = kit.sana_inputs()
    dense = kit.run(model, inputs)
    session = install_diffusion_accelerations(model, {NAME: {"chains": chains}}, registry=kit.make_registry())
    assert torch.equal(kit.run(model, inputs, "r1"), dense)
    counters = kit.record_of(session, "r1", NAME)["counters"]
    assert {c for c in counters if c != "dense_fallback"} == set(chains)
    session.uninstall()


def test_sana_with_optimized_mha_wrappers_is_bitwise(kit: Any) -> None:
    """optimized_mha's shared-input projections hand out views of one GEMM: value is not contiguous."""
    from worldfoundry_optimized_mha.plugin import prepare

    reg = kit.make_registry()
    reg.register("optimized_mha", prepare)
    model = kit.build_sana()
    inputs = kit.sana_inputs()
    spec = {"optimized_mha": {"self": {"fusion": "qkv"}}}
    session = install_diffusion_accelerations(model, spec, registry=reg)
    dense = kit.run(model, inputs, "d")
    session.uninstall()
    session = install_diffusion_accelerations(model, {**spec, NAME: {}}, registry=reg)
    assert torch.equal(kit.run(model, inputs, "r1"), dense)
    assert kit.record_of(session, "r1", NAME)["counters"]["linear_attention"] == 2
    session.uninstall()


def test_precompile_records_the_variants_the_first_forward_launches(kit: Any, monkeypatch: Any) -> None:
    from worldfoundry.core.fusion import adaln, rope
    from worldfoundry_block_fusion.sana_block import SanaBlockRuntime

    model = kit.build_sana()
    inputs = kit.sana_inputs()
    dense = kit.run(model, inputs)
    session = install_diffusion_accelerations(model, {NAME: {}}, registry=kit.make_registry())
    seen: list[set] = []
    original = SanaBlockRuntime.precompile

    def spy(self: Any, *args: Any) -> None:
        original(self, *args)
        seen.append(set(adaln._PLANS) | set(rope._PLANS) | set(rope._NORMALIZE_PLANS))

    monkeypatch.setattr(SanaBlockRuntime, "precompile", spy)
    for plans in (adaln._PLANS, rope._PLANS, rope._NORMALIZE_PLANS):
        plans.clear()
    assert torch.equal(kit.run(model, inputs, "r1"), dense)
    assert len(seen) == 1
    used = set(adaln._PLANS) | set(rope._PLANS) | set(rope._NORMALIZE_PLANS)
    # modulate, gate, cross (contiguous and the first block's transposed stream), relu + rotary, normalisation
    assert len(seen[0]) == 6 and seen[0] == used
    counters = kit.record_of(session, "r1", NAME)["counters"]
    assert counters["modulate"] == 4 and counters["linear_attention"] == 2  # precompilation counts nothing
    session.uninstall()
