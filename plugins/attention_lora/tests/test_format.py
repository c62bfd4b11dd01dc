"""The adapter formats: key naming, the tensor-count rule, every validation error, and the QKV reorder."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.base_models.diffusion_model.optimizations.attention_lora_format import (
    FORMAT_MINIMAX_H3,
    FORMAT_WAN,
    QKV_BLOCKS,
    deinterleave_qkv_rows,
    interleave_qkv_rows,
    minimax_h3_expected_tensor_count,
    parse_attention_lora,
)
from worldfoundry.errors import AccelerationRefusedError, ArtifactMismatchError


def test_real_h3_config_needs_208_tensors() -> None:
    assert minimax_h3_expected_tensor_count(50, 2) == 208
    assert minimax_h3_expected_tensor_count(2, 1) == 12


@pytest.mark.parametrize(("prefix", "infix"), [("", ""), ("diffusion_model.", ""), ("", ".default"),
                                               ("diffusion_model.", ".default"), ("base_model.model.", "")])
def test_h3_naming_variants_map_to_the_same_plan(h3, tools, prefix: str, infix: str) -> None:
    adapter = tools.make_h3_adapter(h3, prefix=prefix, infix=infix)
    plan = parse_attention_lora(h3, adapter.state, rank=4)
    assert plan.format == FORMAT_MINIMAX_H3
    assert plan.tensor_count == plan.expected_tensor_count == 12
    assert set(plan.paths) == set(adapter.expected)
    assert plan.validated_only == tuple(f"token_refiner.refiner_blocks.0.attn.{n}"
                                        for n in ("to_q", "to_k", "to_v", "to_out.0"))
    for proj in plan.projections:
        a, b = adapter.expected[proj.path]
        assert torch.equal(proj.a, a) and torch.equal(proj.b, b), proj.path
    # Q/K/V of one attention read one input and share one A tensor
    by_path = {p.path: p for p in plan.projections}
    q, k, v = (by_path[f"transformer_blocks.0.attn.to_{n}"] for n in "qkv")
    assert q.a is k.a is v.a and q.input_group == k.input_group == v.input_group


def test_count_rule_follows_the_config(tools) -> None:
    model = tools.build_h3(num_layers=3, num_refiner_layers=2)
    plan = parse_attention_lora(model, tools.make_h3_adapter(model).state, rank=4)
    assert plan.tensor_count == 4 * (3 + 2) and len(plan.projections) == 4 * 3 and len(plan.validated_only) == 4 * 2


@settings(max_examples=15, deadline=None)
@given(heads=st.integers(1, 5), head_dim=st.integers(1, 6), rank=st.integers(1, 4))
def test_interleave_roundtrip(heads: int, head_dim: int, rank: int) -> None:
    qkv = [torch.randn(heads * head_dim, rank) for _ in range(3)]
    fused = interleave_qkv_rows(*qkv, heads=heads)
    for h in range(heads):  # the documented layout: [head h: q k v], each head_dim rows
        block = fused[h * 3 * head_dim:(h + 1) * 3 * head_dim]
        for i in range(3):
            assert torch.equal(block[i * head_dim:(i + 1) * head_dim], qkv[i][h * head_dim:(h + 1) * head_dim])
    assert all(torch.equal(x, y) for x, y in zip(deinterleave_qkv_rows(fused, heads, head_dim), qkv, strict=True))


def test_reorder_agrees_with_diffusers_converter(tools) -> None:
    """diffusers de-interleaves files written with PEFT's ``.default`` infix, assuming 128-wide heads."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_minimax_h3_lora_to_diffusers,
    )

    model = tools.build_h3(attention_head_dim=128, hidden_size=64)
    adapter = tools.make_h3_adapter(model, prefix="diffusion_model.", infix=".default")
    converted = _convert_non_diffusers_minimax_h3_lora_to_diffusers(dict(adapter.state))
    plan = parse_attention_lora(model, adapter.state, rank=4)
    assert len(plan.projections) == 8
    for proj in plan.projections:
        assert torch.equal(converted[f"transformer.{proj.path}.lora_A.weight"], proj.a), proj.path
        assert torch.equal(converted[f"transformer.{proj.path}.lora_B.weight"], proj.b), proj.path


def test_qkv_blocks_layout_splits_in_thirds(h3, tools) -> None:
    adapter = tools.make_h3_adapter(h3)
    plan = parse_attention_lora(h3, adapter.state, rank=4, qkv_layout=QKV_BLOCKS)
    fused = adapter.state["blocks.0.attn.qkv_proj.lora_B.weight"]
    by_path = {p.path: p for p in plan.projections}
    for i, n in enumerate("qkv"):
        assert torch.equal(by_path[f"transformer_blocks.0.attn.to_{n}"].b, fused.chunk(3)[i])


def _h3_error(model, state, match: str, rank: int = 4) -> None:
    with pytest.raises(ArtifactMismatchError, match=match):
        parse_attention_lora(model, state, rank=rank)


def test_h3_validation_errors_name_the_key(h3, tools) -> None:
    good = tools.make_h3_adapter(h3).state
    key_b = "blocks.1.attn.qkv_proj.lora_B.weight"
    key_a = "blocks.0.attn.out_proj.lora_A.weight"

    missing = {k: v for k, v in good.items() if k != key_b}
    _h3_error(h3, missing, rf"'{key_b}': missing.*12 tensors = 4 × \(2 \+ 1\), found 11")
    refiner_missing = {k: v for k, v in good.items() if not k.startswith("token_refiner.blocks.0.attn.out_proj.lora_A")}
    _h3_error(h3, refiner_missing, "token_refiner.blocks.0.attn.out_proj.lora_A.weight': missing")
    _h3_error(h3, {**good, "blocks.0.mlp.fc1.lora_A.weight": torch.zeros(4, 48)}, "'blocks.0.mlp.fc1.lora_A.weight': not an attention")
    _h3_error(h3, {**good, "blocks.0.attn.qkv_proj.alpha": torch.tensor(4.0)}, "'blocks.0.attn.qkv_proj.alpha'")
    _h3_error(h3, {**good, "blocks.2.attn.out_proj.lora_A.weight": good[key_a]}, "'blocks.2.attn.out_proj.lora_A.weight': block index 2")
    _h3_error(h3, {**good, f"diffusion_model.{key_a}": good[key_a]}, f"'diffusion_model.{key_a}': duplicates '{key_a}'")
    _h3_error(h3, {**good, key_a: good[key_a].double()}, f"'{key_a}': dtype torch.float64")
    _h3_error(h3, {**good, key_a: good[key_a].bfloat16()}, f"'{key_a}': dtype torch.bfloat16")
    _h3_error(h3, {**good, key_a: good[key_a].numpy()}, f"'{key_a}': expected a tensor")
    _h3_error(h3, {**good, key_a: good[key_a].to("meta")}, f"'{key_a}': on meta; pass the adapter state on the CPU")
    _h3_error(h3, {**good, key_a: good[key_a].reshape(-1)}, f"'{key_a}': expected a 2-D")
    _h3_error(h3, {**good, key_a: good[key_a][:, :10]}, rf"'{key_a}': shape \(4, 10\), the model needs \(4, 64\)")
    _h3_error(h3, {**good, key_b: good[key_b][:-3]}, rf"'{key_b}': shape \(189, 4\), the model needs \(192, 4\)")
    nan = good[key_a].clone()
    nan[0, 0] = float("nan")
    _h3_error(h3, {**good, key_a: nan}, f"'{key_a}': contains NaN or Inf")
    inf = good[key_b].clone()
    inf[1, 1] = float("inf")
    _h3_error(h3, {**good, key_b: inf}, f"'{key_b}': contains NaN or Inf")
    _h3_error(h3, good, "'blocks.0.attn.qkv_proj.lora_A.weight': rank 4 in the file, but rank=8 was given", rank=8)
    _h3_error(h3, {}, "empty")
    _h3_error(h3, [1, 2], "mapping")  # type: ignore[arg-type]
    _h3_error(h3, {**good, 3: good[key_a]}, "keys must be strings")  # type: ignore[dict-item]
    wan_named = {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 48)}
    _h3_error(h3, wan_named, "'transformer.blocks.0.attn1.to_q.lora_A.weight': not an attention LoRA key")


def test_rank_mismatch_inside_the_file(h3, tools) -> None:
    good = tools.make_h3_adapter(h3).state
    other = tools.make_h3_adapter(h3, rank=2).state
    mixed = {**good, "blocks.1.attn.out_proj.lora_A.weight": other["blocks.1.attn.out_proj.lora_A.weight"]}
    _h3_error(h3, mixed, "'blocks.1.attn.out_proj.lora_A.weight': rank 2 in the file, but rank=4")


def test_invalid_arguments(h3, tools) -> None:
    state = tools.make_h3_adapter(h3).state
    with pytest.raises(ValueError, match="rank"):
        parse_attention_lora(h3, state, rank=0)
    with pytest.raises(ValueError, match="qkv_layout"):
        parse_attention_lora(h3, state, rank=4, qkv_layout="interleaved")


def test_wan_format(wan, tools) -> None:
    adapter = tools.make_wan_adapter(wan, prefix="transformer.", infix=".default")
    plan = parse_attention_lora(wan, adapter.state, rank=4)
    assert plan.format == FORMAT_WAN and plan.expected_tensor_count is None and plan.validated_only == ()
    assert len(plan.projections) == 2 * 2 * 4 and set(plan.paths) == set(adapter.expected)
    groups = {p.path: p.input_group for p in plan.projections}
    assert groups["blocks.0.attn1.to_q"] == groups["blocks.0.attn1.to_k"] == groups["blocks.0.attn1.to_v"]
    assert groups["blocks.0.attn2.to_k"] == groups["blocks.0.attn2.to_v"] != groups["blocks.0.attn2.to_q"]
    assert groups["blocks.0.attn1.to_out.0"] == "blocks.0.attn1.to_out.0"


def test_wan_partial_adapter_and_errors(wan, tools) -> None:
    partial = tools.make_wan_adapter(wan, projections=("to_q", "to_v"), attentions=("attn1",)).state
    plan = parse_attention_lora(wan, partial, rank=4)
    assert sorted(plan.paths) == ["blocks.0.attn1.to_q", "blocks.0.attn1.to_v", "blocks.1.attn1.to_q", "blocks.1.attn1.to_v"]
    key_a = "blocks.0.attn1.to_q.lora_A.weight"
    lonely = {k: v for k, v in partial.items() if k != "blocks.0.attn1.to_q.lora_B.weight"}
    with pytest.raises(ArtifactMismatchError, match=f"'{key_a}': its lora_B partner"):
        parse_attention_lora(wan, lonely, rank=4)
    for bad_key in ("blocks.0.attn2.add_k_proj.lora_A.weight", "blocks.0.ffn.net.0.proj.lora_A.weight",
                    "diffusion_model.blocks.0.self_attn.q.lora_A.weight", "blocks.0.attn1.to_q.lora_A.other.weight"):
        with pytest.raises(ArtifactMismatchError, match=f"'{bad_key}': not an attention LoRA key"):
            parse_attention_lora(wan, {**partial, bad_key: partial[key_a]}, rank=4)
    with pytest.raises(ArtifactMismatchError, match="block index 5"):
        parse_attention_lora(wan, {**partial, "blocks.5.attn1.to_q.lora_A.weight": partial[key_a]}, rank=4)
    with pytest.raises(ArtifactMismatchError, match=f"'{key_a}': dtype torch.bfloat16"):
        parse_attention_lora(wan, {**partial, key_a: partial[key_a].bfloat16()}, rank=4)
    with pytest.raises(ArtifactMismatchError, match=f"'{key_a}': rank 4 in the file, but rank=2"):
        parse_attention_lora(wan, partial, rank=2)


def test_unsupported_family_is_refused() -> None:
    with pytest.raises(AccelerationRefusedError, match="not a supported DiT"):
        parse_attention_lora(torch.nn.Linear(2, 2), {"x": torch.zeros(1)}, rank=1)
