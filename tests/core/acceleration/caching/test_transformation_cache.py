"""EasyCache numerics: transformation, rate, error increment, estimate and dense gates."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.caching import (
    TransformationCache,
    dense_gate,
    mean_abs,
    mean_abs_diff,
)


def _pair(seed: int, shape=(2, 3, 4)):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)


def test_first_computed_step_has_no_rate():
    cache = TransformationCache(track_rate=True)
    x, v = _pair(0)
    cache.record_computed(x, v)
    assert cache.rate is None
    assert cache.error_increment(x) is None
    assert torch.equal(cache.delta, v - x)


def test_rate_and_increment_follow_the_definitions():
    cache = TransformationCache(track_rate=True)
    x0, v0 = _pair(0)
    x1, v1 = _pair(1)
    cache.record_computed(x0, v0)
    cache.record_computed(x1, v1)
    k = (v1 - v0).abs().mean() / (x1 - x0).abs().mean()
    assert torch.allclose(cache.rate, k, rtol=1e-6, atol=0)
    x2 = x1 + 0.1 * torch.randn_like(x1)
    expected = k * (x2 - x1).abs().mean() / v1.abs().mean()
    assert torch.allclose(cache.error_increment(x2), expected, rtol=1e-6, atol=0)
    # after a reused step the increment is measured from that step's input
    cache.observe_input(x2)
    x3 = x2 + 0.2 * torch.randn_like(x2)
    expected = k * (x3 - x2).abs().mean() / v1.abs().mean()
    assert torch.allclose(cache.error_increment(x3), expected, rtol=1e-6, atol=0)


def test_estimate_is_input_plus_delta_in_the_output_dtype():
    cache = TransformationCache(track_rate=False)
    x, v = _pair(2)
    cache.record_computed(x.bfloat16(), v.bfloat16())
    x_new = x + 0.5
    out = cache.estimate(x_new.bfloat16(), torch.bfloat16)
    assert out.dtype == torch.bfloat16
    expected = (x_new.bfloat16().float() + (v.bfloat16().float() - x.bfloat16().float())).bfloat16()
    assert torch.equal(out, expected)
    assert cache.rate is None and cache.last_input is None  # a follower keeps Δ only


def test_inputs_are_copied_so_later_in_place_edits_do_not_leak_in():
    cache = TransformationCache(track_rate=True)
    x, v = _pair(3)
    cache.record_computed(x, v)
    delta = cache.delta.clone()
    x.add_(100.0)
    v.add_(100.0)
    assert torch.equal(cache.delta, delta)
    assert not torch.equal(cache.last_input, x)


def test_shape_changes_disable_reuse_and_clear_drops_everything():
    cache = TransformationCache(track_rate=True)
    x, v = _pair(4)
    cache.record_computed(x, v)
    cache.record_computed(x + 1, v + 2)
    assert cache.can_reuse(x)
    bigger = torch.zeros(2, 3, 5)
    assert not cache.can_reuse(bigger)
    assert cache.error_increment(bigger) is None
    with pytest.raises(ValueError, match="no cached transformation"):
        cache.estimate(bigger, torch.float32)
    assert len(cache.tensors()) == 4  # delta, last input (== previous input), last output, rate
    cache.clear()
    assert cache.tensors() == [] and not cache.can_reuse(x)
    with pytest.raises(ValueError, match="one shape"):
        cache.record_computed(x, bigger)


def test_zero_input_change_gives_a_non_finite_rate_that_a_threshold_rejects():
    cache = TransformationCache(track_rate=True)
    x, v = _pair(5)
    cache.record_computed(x, v)
    cache.record_computed(x, v + 1)  # same input, different output
    inc = cache.error_increment(x + 0.1)
    assert not math.isfinite(float(inc))


def test_means_are_float32():
    t = torch.tensor([1.0, -3.0], dtype=torch.bfloat16)
    assert mean_abs(t).dtype == torch.float32 and float(mean_abs(t)) == 2.0
    assert float(mean_abs_diff(t, torch.zeros(2))) == 2.0


@settings(max_examples=50, deadline=None)
@given(length=st.integers(1, 60), warmup=st.integers(0, 70), final=st.integers(0, 70), data=st.data())
def test_dense_gate_positions(length, warmup, final, data):
    i = data.draw(st.integers(0, length - 1))
    gate = dense_gate(i, length, warmup, final)
    if i < warmup:
        assert gate == "warmup"
    elif i >= length - final:
        assert gate == "final"
    else:
        assert gate is None
    with pytest.raises(ValueError):
        dense_gate(length, length, warmup, final)
