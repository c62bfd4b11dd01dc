"""Pattern -> Linear selection: patterns, excludes, names per model family, refusals with near matches."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from worldfoundry import testing
from worldfoundry.base_models.diffusion_model.optimizations.projection_selection import (
    linear_name_patterns,
    refuse_misaligned,
    refuse_shared_parameters,
    select_linears,
)
from worldfoundry.errors import AccelerationRefusedError

P = "demo"


def tiny_wan() -> nn.Module:
    return testing.tiny_wan(weight_scale=None)


def tiny_sana_video() -> nn.Module:
    return testing.tiny_sana_video()


def tiny_minimax_h3() -> nn.Module:
    return testing.tiny_minimax_h3(hidden_size=64, ffn_dim=128, in_channels=8, time_embed_hidden_dim=64,
                                   time_embed_dim=32, rope_freq_dim=8)


def paths(selection) -> list[str]:
    return [s.path for s in selection]


def test_wan_ffn_patterns():
    model = tiny_wan()
    sel = select_linears(model, ["blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2"], plugin=P)
    assert paths(sel) == [
        "blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2"]
    assert all(type(s.module) is nn.Linear and s.module is model.get_submodule(s.path) for s in sel)


def test_wan_exclude_and_star_crosses_dots():
    model = tiny_wan()
    sel = select_linears(model, ["blocks.*.ffn.*"], ["blocks.1.*"], plugin=P)
    assert paths(sel) == ["blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2"]
    kv = select_linears(model, ["blocks.*.to_k", "blocks.*.to_v"], plugin=P)
    assert paths(kv) == [f"blocks.{i}.attn{a}.to_{p}" for i in (0, 1) for a in (1, 2) for p in ("k", "v")]
    cross_only = select_linears(model, ["blocks.*.attn2.to_[kv]"], plugin=P)
    assert paths(cross_only) == [
        "blocks.0.attn2.to_k", "blocks.0.attn2.to_v", "blocks.1.attn2.to_k", "blocks.1.attn2.to_v"]
    # overlapping patterns select each module once, in model order
    assert paths(select_linears(model, ["blocks.0.ffn.net.2", "blocks.*.ffn.net.2"], plugin=P)) == [
        "blocks.0.ffn.net.2", "blocks.1.ffn.net.2"]


def test_sana_video_has_no_linear_ffn_but_attention_projections_select():
    model = tiny_sana_video()
    with pytest.raises(AccelerationRefusedError) as info:
        select_linears(model, ["transformer_blocks.*.ff.*"], plugin=P)
    message = str(info.value)
    assert "matches no nn.Linear" in message and "Conv2d" in message
    assert "transformer_blocks.*.attn1.to_q" in message  # the names that do exist are listed
    sel = select_linears(model, ["transformer_blocks.*.attn1.to_q", "transformer_blocks.*.attn2.to_out.0"], plugin=P)
    assert paths(sel) == ["transformer_blocks.0.attn1.to_q", "transformer_blocks.0.attn2.to_out.0",
                          "transformer_blocks.1.attn1.to_q", "transformer_blocks.1.attn2.to_out.0"]


def test_minimax_h3_ffn_names():
    model = tiny_minimax_h3()
    sel = select_linears(model, ["transformer_blocks.*.ff.net.0.proj", "transformer_blocks.*.ff.net.2"], plugin=P)
    assert paths(sel) == ["transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.ff.net.2",
                          "transformer_blocks.1.ff.net.0.proj", "transformer_blocks.1.ff.net.2"]
    refiner = select_linears(model, ["token_refiner.refiner_blocks.*.ff.net.2"], plugin=P)
    assert paths(refiner) == ["token_refiner.refiner_blocks.0.ff.net.2"]


def test_linear_name_patterns_per_family():
    wan = linear_name_patterns(tiny_wan())
    assert wan[-3:] == ["blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2", "proj_out"]
    assert "blocks.*.attn2.to_out.0" in wan
    sana = linear_name_patterns(tiny_sana_video())
    assert "transformer_blocks.*.attn1.to_q" in sana and not any(".ff." in p for p in sana)
    h3 = linear_name_patterns(tiny_minimax_h3())
    assert {"transformer_blocks.*.ff.net.0.proj", "transformer_blocks.*.ff.net.2",
            "token_refiner.refiner_blocks.0.ff.net.2"} <= set(h3)  # one refiner block: its index stays


def test_empty_match_lists_near_matches():
    model = tiny_wan()
    with pytest.raises(AccelerationRefusedError) as info:
        select_linears(model, ["blocks.*.ff.net.0.proj"], plugin=P)
    assert "near matches: blocks.*.ffn.net.0.proj" in str(info.value)
    with pytest.raises(AccelerationRefusedError, match="non-Linear modules: blocks.0.ffn"):
        select_linears(model, ["blocks.*.ffn"], plugin=P)
    with pytest.raises(AccelerationRefusedError, match="no include patterns"):
        select_linears(model, [], plugin=P)


def test_exclude_errors():
    model = tiny_wan()
    with pytest.raises(AccelerationRefusedError, match="exclude pattern 'blocks.*.fnn.net.2' matches no module"):
        select_linears(model, ["blocks.*.ffn.net.2"], ["blocks.*.fnn.net.2"], plugin=P)
    with pytest.raises(AccelerationRefusedError, match="remove every Linear"):
        select_linears(model, ["blocks.*.ffn.net.2"], ["blocks.*"], plugin=P)


class ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_linear_subclass_and_replaced_forward_are_refused():
    model = nn.Sequential(nn.Linear(16, 16), ScaledLinear(16, 16), nn.Linear(16, 16))
    with pytest.raises(AccelerationRefusedError, match=r"Linear subclasses.*1 \(.*ScaledLinear\)"):
        select_linears(model, ["*"], plugin=P)
    assert paths(select_linears(model, ["*"], ["1"], plugin=P)) == ["0", "2"]
    model[2].forward = lambda x: x
    with pytest.raises(AccelerationRefusedError, match="replaced forward.*2"):
        select_linears(model, ["0", "2"], plugin=P)


def test_one_module_under_two_names_is_refused():
    shared = nn.Linear(16, 16)
    model = nn.Module()
    model.a = shared
    model.b = shared
    with pytest.raises(AccelerationRefusedError, match="reachable under several names"):
        select_linears(model, ["a"], plugin=P)


def test_shared_parameter_storage_is_refused():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    model[1].weight = model[0].weight  # tied
    sel = select_linears(model, ["0"], plugin=P)
    with pytest.raises(AccelerationRefusedError, match=r"0.weight shares parameter storage with 1.weight"):
        refuse_shared_parameters(model, sel, plugin=P)
    view_model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    flat = torch.zeros(2 * 16 * 16)
    view_model[0].weight = nn.Parameter(flat[:256].view(16, 16))
    view_model[1].weight = nn.Parameter(flat[256:].view(16, 16))
    with pytest.raises(AccelerationRefusedError, match="shares parameter storage"):
        refuse_shared_parameters(view_model, select_linears(view_model, ["1"], plugin=P), plugin=P)
    untied = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    refuse_shared_parameters(untied, select_linears(untied, ["*"], plugin=P), plugin=P)


def test_meta_weights_are_refused():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(AccelerationRefusedError, match="meta device"):
        refuse_shared_parameters(model, select_linears(model, ["0"], plugin=P), plugin=P)


def test_misaligned_dimensions_are_listed():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 40), nn.Linear(40, 24), nn.Linear(24, 48))
    sel = select_linears(model, ["*"], plugin=P)
    with pytest.raises(AccelerationRefusedError) as info:
        refuse_misaligned(sel, 16, plugin=P, why="GEMM alignment")
    message = str(info.value)
    assert "1 (out_features=40)" in message and "2 (in_features=40, out_features=24)" in message
    assert "3 (in_features=24)" in message and "GEMM alignment" in message and "0 (" not in message
    refuse_misaligned(sel[:1], 16, plugin=P)
