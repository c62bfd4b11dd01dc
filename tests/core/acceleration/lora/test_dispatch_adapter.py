"""Dispatcher (visible reference fallback) and the runtime projection objects (shared down step, cache)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.lora import (
    LoraKernelStats,
    LoraProjection,
    SharedDownProjection,
    canonical_device,
    kernel_unavailable_reason,
    lora_down,
    lora_down_reference,
    lora_linear_reference,
    lora_up_add,
    split_bf16x3,
    stack_down_groups,
)
from worldfoundry.core.acceleration.lora.reference import RANK_TILE


def test_cpu_uses_the_reference_and_counts_it() -> None:
    stats = LoraKernelStats()
    x = torch.randn(2, 5, 16).to(torch.bfloat16)
    a, b = torch.randn(4, 16), torch.randn(12, 4)
    base = torch.randn(2, 5, 12).to(torch.bfloat16)
    t = lora_down(x, a, split_bf16x3(a), stats)
    y = lora_up_add(base, t, b, 0.5, stats)
    assert y.shape == base.shape and y.dtype == torch.bfloat16
    assert torch.equal(y, lora_linear_reference(x, base, a, b, 0.5))
    assert stats.to_json() == {"triton_calls": 0, "reference_calls": 2, "fallback_reasons": {"cpu": 2},
                               "shared_down": {}}
    assert kernel_unavailable_reason(x, 4) == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_uses_the_kernel_and_names_fallbacks() -> None:
    stats = LoraKernelStats()
    x = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    a = torch.randn(8, 256, device="cuda")
    lora_down(x, a, split_bf16x3(a), stats)
    lora_down(x.double(), a, None, stats)
    lora_down(x, torch.randn(200, 256, device="cuda"), None, stats)
    assert stats.triton_calls == 1
    assert stats.fallback_reasons == {"dtype_float64": 1, "rank_above_128": 1}


def _group(a_by_name: dict[str, torch.Tensor], out: int = 5, scale: float = 0.3, seed: int = 0):
    """A shared down step and its projections built the way the plugin builds them."""
    g = torch.Generator().manual_seed(seed)
    (stacked, offsets), = stack_down_groups(list(a_by_name.items()))
    down = SharedDownProjection(stacked, device="cpu")
    projections = {n: LoraProjection(down, offsets[n], torch.randn(out, a.shape[0], generator=g), scale, "cpu")
                   for n, a in a_by_name.items()}
    return down, projections


def test_shared_down_step_runs_once_per_input() -> None:
    stats = LoraKernelStats()
    g = torch.Generator().manual_seed(0)
    a_q, a_k = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    (stacked, offsets), = stack_down_groups([("q", a_q), ("k", a_k), ("v", a_q)])
    assert offsets == {"q": 0, "k": RANK_TILE, "v": 0} and stacked.shape == (2 * RANK_TILE, 8)
    assert torch.equal(stacked[:3], a_q) and torch.equal(stacked[RANK_TILE:RANK_TILE + 3], a_k)
    assert not stacked[3:RANK_TILE].any() and not stacked[RANK_TILE + 3:].any()
    _, projections = _group({"q": a_q, "k": a_k, "v": a_q})
    x = torch.randn(4, 8, generator=g)
    base = torch.randn(4, 5, generator=g)
    outputs = {n: p.apply(x, base, stats) for n, p in projections.items()}
    assert stats.reference_calls == 1 + 3, "one shared down step and three up steps"
    assert stats.shared_down == {"group_computed": 1, "handed_over": 2}
    for n, p in projections.items():
        a = a_k if n == "k" else a_q
        expected = lora_linear_reference(x, base, a, p.b_on(torch.device("cpu")), 0.3)
        assert torch.equal(outputs[n], expected), n  # the stacked step gives each member bitwise its own result
    # a new input starts a new group step; a member called with another input while that step waits for its
    # members computes its own columns
    other = x.clone()
    projections["q"].apply(other, base, stats)
    assert stats.shared_down == {"group_computed": 2, "handed_over": 2}
    assert torch.equal(projections["k"].apply(x, base, stats), outputs["k"])
    assert stats.shared_down["own:other_input"] == 1 and stats.reference_calls == 4 + 2 + 2
    # q again starts a new step (k and v never took `other`'s columns: 2 dropped); then the cached tensor
    # changes in place: the next member starts a new group step (2 more dropped)
    projections["q"].apply(x, base, stats)
    x.mul_(2.0)
    projections["k"].apply(x, base, stats)
    projections["v"].apply(x, base, stats)
    assert stats.shared_down == {"group_computed": 4, "handed_over": 3, "own:other_input": 1, "dropped_unused": 4}
    assert stats.reference_calls == 8 + 2 + 2 + 1


def test_own_columns_equal_the_group_columns() -> None:
    """A member computing only its own tiles gets bitwise the columns of the group step (reference path)."""
    g = torch.Generator().manual_seed(4)
    a = {n: torch.randn(r, 24, generator=g) for n, r in (("q", 8), ("k", 20), ("v", 3))}
    down, projections = _group(a, out=7, scale=-0.6)
    x = torch.randn(9, 24, generator=g).to(torch.bfloat16)
    base = torch.randn(9, 7, generator=g).to(torch.bfloat16)
    stats = LoraKernelStats()
    grouped = {n: p.apply(x, base, stats) for n, p in projections.items()}
    other = x.clone()
    projections["q"].apply(other, base, stats)  # a group step for `other`, k and v still waiting
    own = {n: projections[n].apply(x, base, stats) for n in ("k", "v")}
    assert stats.shared_down["own:other_input"] == 2
    for n in ("k", "v"):
        assert torch.equal(own[n], grouped[n]), n
        t_alone = lora_down_reference(x, a[n])
        t_group = lora_down_reference(x, down.weights_on(torch.device("cpu"))[0])
        offset = projections[n].offset
        assert torch.equal(t_group[:, offset:offset + a[n].shape[0]], t_alone), n


def test_repeated_member_starts_a_new_group_step() -> None:
    stats = LoraKernelStats()
    down, projections = _group({"k": torch.randn(2, 4), "v": torch.randn(2, 4)})
    x, base = torch.randn(5, 4), torch.randn(5, 5)
    projections["k"].apply(x, base, stats)
    projections["k"].apply(x, base, stats)  # k again before v: v's columns of the first step are never used
    projections["v"].apply(x, base, stats)
    assert stats.shared_down == {"group_computed": 2, "dropped_unused": 1, "handed_over": 1}
    projections["k"].apply(x, base, stats)
    down.clear_cache()
    projections["v"].apply(x, base, stats)
    assert stats.shared_down["group_computed"] == 4


def test_inference_mode_inputs_are_shared_by_identity() -> None:
    stats = LoraKernelStats()
    a = {"q": torch.randn(2, 4), "k": torch.randn(2, 4)}
    _, projections = _group(a, out=3, scale=1.0)
    with torch.inference_mode():
        x, base = torch.randn(5, 4), torch.randn(5, 3)
        outputs = {n: p.apply(x, base, stats) for n, p in projections.items()}
    assert stats.reference_calls == 1 + 2 and stats.shared_down == {"group_computed": 1, "handed_over": 1}
    expected = lora_linear_reference(x, base, a["k"], projections["k"].b_on(torch.device("cpu")), 1.0)
    assert torch.equal(outputs["k"], expected)


def test_cache_does_not_keep_activations_alive() -> None:
    down, projections = _group({"q": torch.randn(2, 4), "k": torch.randn(2, 4)}, out=3)
    x = torch.randn(5, 4)
    ref = weakref.ref(x)
    projections["q"].apply(x, torch.randn(5, 3))
    del x
    gc.collect()
    assert ref() is None
    stats = LoraKernelStats()
    projections["k"].apply(torch.randn(5, 4), torch.randn(5, 3), stats)  # the entry's input is gone: new step
    assert stats.shared_down == {"dropped_unused": 1, "group_computed": 1}
    down.release()
    for p in projections.values():
        p.release()


def test_stacking_respects_the_rank_limit_and_features() -> None:
    members = [(f"p{i}", torch.randn(40, 6)) for i in range(4)]
    groups = stack_down_groups(members, max_rank=100)  # 40 rows occupy 48 (three tiles)
    assert [g[0].shape[0] for g in groups] == [96, 96]
    assert groups[0][1] == {"p0": 0, "p1": 48} and groups[1][1] == {"p2": 0, "p3": 48}
    big = stack_down_groups([("a", torch.randn(200, 6)), ("b", torch.randn(8, 6))], max_rank=128)
    assert [g[0].shape[0] for g in big] == [208, 16]
    with pytest.raises(ValueError, match="in_features"):
        stack_down_groups([("a", torch.randn(2, 4)), ("b", torch.randn(2, 5))])


def test_projection_argument_checks() -> None:
    down = SharedDownProjection(torch.randn(2, 4), device="cpu")
    with pytest.raises(ValueError, match="exceeds"):
        LoraProjection(down, 1, torch.randn(3, 2), 1.0, "cpu")
    with pytest.raises(ValueError, match="tile boundary"):
        LoraProjection(SharedDownProjection(torch.randn(32, 4), device="cpu"), 8, torch.randn(3, 2), 1.0, "cpu")
    proj = LoraProjection(down, 0, torch.randn(3, 2), 1.0, "cpu")
    with pytest.raises(ValueError, match="features"):
        proj.apply(torch.randn(5, 6), torch.randn(5, 3))
    with pytest.raises(ValueError, match="rows"):
        proj.apply(torch.randn(5, 4), torch.randn(4, 3))
    with pytest.raises(ValueError, match="float32"):
        SharedDownProjection(torch.randn(2, 4, dtype=torch.float64), device="cpu")
    with pytest.raises(ValueError, match="float32"):
        LoraProjection(down, 0, torch.randn(3, 2, dtype=torch.float64), 1.0, "cpu")
    assert canonical_device("cpu") == torch.device("cpu")
    b = proj.b_on(torch.device("cpu"))
    assert b.shape == (3, 2) and b.stride() == (1, 3), "B is kept as a contiguous Bᵀ"


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), rank=st.integers(1, 6), scale=st.floats(-1, 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_projection_equals_reference(rows: int, rank: int, scale: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * 7 + rank)
    a, b = torch.randn(rank, 12, generator=g), torch.randn(9, rank, generator=g)
    x = torch.randn(rows, 12, generator=g).to(dtype)
    base = torch.randn(rows, 9, generator=g).to(dtype)
    proj = LoraProjection(SharedDownProjection(a, device="cpu"), 0, b, scale, "cpu")
    assert torch.equal(proj.apply(x, base), lora_linear_reference(x, base, a, b, scale))
