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
    lora_linear_reference,
    lora_up_add,
    split_bf16x3,
    stack_down_groups,
)


def test_cpu_uses_the_reference_and_counts_it() -> None:
    stats = LoraKernelStats()
    x = torch.randn(2, 5, 16).to(torch.bfloat16)
    a, b = torch.randn(4, 16), torch.randn(12, 4)
    base = torch.randn(2, 5, 12).to(torch.bfloat16)
    t = lora_down(x, a, split_bf16x3(a), stats)
    y = lora_up_add(base, t, b, 0.5, stats)
    assert y.shape == base.shape and y.dtype == torch.bfloat16
    assert torch.equal(y, lora_linear_reference(x, base, a, b, 0.5))
    assert stats.to_json() == {"triton_calls": 0, "reference_calls": 2, "fallback_reasons": {"cpu": 2}}
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


def test_shared_down_step_runs_once_per_input() -> None:
    stats = LoraKernelStats()
    g = torch.Generator().manual_seed(0)
    a_q, a_k = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    (stacked, offsets), = stack_down_groups([("q", a_q), ("k", a_k), ("v", a_q)])
    assert offsets == {"q": 0, "k": 3, "v": 0} and stacked.shape == (6, 8)
    down = SharedDownProjection(stacked, consumers=3, device="cpu")
    projections = {n: LoraProjection(down, offsets[n], torch.randn(5, 3, generator=g), 0.3, "cpu") for n in "qkv"}
    x = torch.randn(4, 8, generator=g)
    base = torch.randn(4, 5, generator=g)
    outputs = {n: p.apply(x, base, stats) for n, p in projections.items()}
    assert stats.reference_calls == 1 + 3, "one shared down step and three up steps"
    for n, p in projections.items():
        a = a_k if n == "k" else a_q
        expected = lora_linear_reference(x, base, a, p.b_on(torch.device("cpu")), 0.3)
        assert torch.allclose(outputs[n], expected, rtol=1e-6, atol=1e-6), n
    # a new input, or the same tensor changed in place, is recomputed
    projections["q"].apply(x.clone(), base, stats)
    assert stats.reference_calls == 4 + 2
    projections["k"].apply(x, base, stats)
    x.mul_(2.0)
    projections["v"].apply(x, base, stats)
    assert stats.reference_calls == 6 + 2 + 2


def test_inference_mode_inputs_are_shared_by_identity() -> None:
    stats = LoraKernelStats()
    (stacked, offsets), = stack_down_groups([("q", torch.randn(2, 4)), ("k", torch.randn(2, 4))])
    down = SharedDownProjection(stacked, consumers=2, device="cpu")
    projections = [LoraProjection(down, offsets[n], torch.randn(3, 2), 1.0, "cpu") for n in ("q", "k")]
    with torch.inference_mode():
        x, base = torch.randn(5, 4), torch.randn(5, 3)
        outputs = [p.apply(x, base, stats) for p in projections]
    assert stats.reference_calls == 1 + 2
    expected = lora_linear_reference(x, base, stacked[2:], projections[1].b_on(torch.device("cpu")), 1.0)
    assert torch.allclose(outputs[1], expected, rtol=1e-6, atol=1e-6)


def test_cache_does_not_keep_activations_alive() -> None:
    (stacked, _), = stack_down_groups([("q", torch.randn(2, 4)), ("k", torch.randn(2, 4))])
    down = SharedDownProjection(stacked, consumers=2, device="cpu")
    proj = LoraProjection(down, 0, torch.randn(3, 2), 1.0, "cpu")
    x = torch.randn(5, 4)
    ref = weakref.ref(x)
    proj.apply(x, torch.randn(5, 3))
    del x
    gc.collect()
    assert ref() is None
    down.release()
    proj.release()


def test_stacking_respects_the_rank_limit_and_features() -> None:
    members = [(f"p{i}", torch.randn(40, 6)) for i in range(4)]
    groups = stack_down_groups(members, max_rank=100)
    assert [g[0].shape[0] for g in groups] == [80, 80]
    assert groups[0][1] == {"p0": 0, "p1": 40} and groups[1][1] == {"p2": 0, "p3": 40}
    with pytest.raises(ValueError, match="in_features"):
        stack_down_groups([("a", torch.randn(2, 4)), ("b", torch.randn(2, 5))])


def test_projection_argument_checks() -> None:
    down = SharedDownProjection(torch.randn(2, 4), consumers=1, device="cpu")
    with pytest.raises(ValueError, match="exceeds"):
        LoraProjection(down, 1, torch.randn(3, 2), 1.0, "cpu")
    proj = LoraProjection(down, 0, torch.randn(3, 2), 1.0, "cpu")
    with pytest.raises(ValueError, match="features"):
        proj.apply(torch.randn(5, 6), torch.randn(5, 3))
    with pytest.raises(ValueError, match="rows"):
        proj.apply(torch.randn(5, 4), torch.randn(4, 3))
    with pytest.raises(ValueError, match="float32"):
        SharedDownProjection(torch.randn(2, 4, dtype=torch.float64), consumers=1, device="cpu")
    assert canonical_device("cpu") == torch.device("cpu")


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), rank=st.integers(1, 6), scale=st.floats(-1, 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_projection_equals_reference(rows: int, rank: int, scale: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * 7 + rank)
    a, b = torch.randn(rank, 12, generator=g), torch.randn(9, rank, generator=g)
    x = torch.randn(rows, 12, generator=g).to(dtype)
    base = torch.randn(rows, 9, generator=g).to(dtype)
    proj = LoraProjection(SharedDownProjection(a, consumers=1, device="cpu"), 0, b, scale, "cpu")
    assert torch.equal(proj.apply(x, base), lora_linear_reference(x, base, a, b, scale))
