"""Fused projections: one GEMM then split, exact by per-geometry verification."""

from __future__ import annotations

import threading

import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.attention.fused_projection import (
    NOT_BITWISE,
    SharedInputProjection,
    fused_linear,
    outputs_equal,
    separate_linears,
)
from worldfoundry.core.attention.packed_storage import PackedLinearParameters, PackedWeights


def _linears(in_features: int, outs: tuple[int, ...], bias: bool, dtype: torch.dtype, seed: int) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(in_features, o, bias=bias).to(dtype) for o in outs]


def _reference(x: torch.Tensor, linears: list[nn.Linear]) -> tuple[torch.Tensor, ...]:
    return separate_linears(x, [m.weight for m in linears], [m.bias for m in linears])


def test_fused_linear_returns_views_of_one_output() -> None:
    linears = _linears(32, (32, 32, 32), True, torch.float32, 0)
    pack = PackedLinearParameters.pack(linears)
    x = torch.randn(2, 10, 32)
    parts = fused_linear(x, pack.weight, pack.bias, pack.split_sizes)
    assert [p.shape[-1] for p in parts] == [32, 32, 32]
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1
    assert outputs_equal(parts, _reference(x, linears))


@settings(max_examples=25, deadline=None)
@given(
    in_features=st.integers(1, 40),
    outs=st.lists(st.integers(1, 24), min_size=2, max_size=3).map(tuple),
    rows=st.integers(1, 70),
    batch=st.integers(1, 2),
    bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_shared_projection_always_matches_the_separate_projections(in_features: int, outs: tuple[int, ...],
                                                                    rows: int, batch: int, bias: bool,
                                                                    dtype: torch.dtype, seed: int) -> None:
    """Invariant: whatever the GEMM library does for a shape, the outputs equal the dense ones bitwise."""
    linears = _linears(in_features, outs, bias, dtype, seed)
    pack = PackedLinearParameters.pack(linears)
    projection = SharedInputProjection(pack.split_sizes, pack.current)
    originals = [m.forward for m in linears]
    x = torch.randn(batch, rows, in_features, generator=torch.Generator().manual_seed(seed)).to(dtype)
    first = projection.compute(x, originals)
    second = projection.compute(x, originals)
    expected = _reference(x, linears)
    assert outputs_equal(first.outputs, expected) and outputs_equal(second.outputs, expected)
    assert first.verified and not second.verified
    assert first.fused == second.fused
    assert (first.reason is None) == first.fused


def test_a_known_non_bitwise_shape_runs_the_separate_projections() -> None:
    # A packed weight that is not the members' weights stands for a GEMM that rounds differently.
    linears = _linears(8, (8, 8), True, torch.float32, 1)
    real = PackedLinearParameters.pack(linears)
    off = PackedWeights(real.weight + 1e-3, real.bias, (0,))
    projection = SharedInputProjection(real.split_sizes, lambda: off)
    x = torch.randn(1, 4, 8)
    result = projection.compute(x, [m.forward for m in linears])
    assert not result.fused and result.reason == NOT_BITWISE and result.verified
    assert outputs_equal(result.outputs, _reference(x, linears))
    again = projection.compute(x, [m.forward for m in linears])
    assert not again.fused and not again.verified and outputs_equal(again.outputs, _reference(x, linears))
    assert list(projection.verdicts().values()) == [False]


def test_unusable_packed_weights_fall_back_with_the_reason() -> None:
    linears = _linears(8, (8, 8), False, torch.float32, 2)
    projection = SharedInputProjection((8, 8), lambda: "parameter_replaced")
    x = torch.randn(3, 8)
    result = projection.compute(x, [m.forward for m in linears])
    assert result.reason == "parameter_replaced" and not result.fused
    assert outputs_equal(result.outputs, _reference(x, linears))


def test_followers_take_their_slice_only_for_the_same_input() -> None:
    linears = _linears(8, (8, 8, 8), True, torch.float32, 3)
    pack = PackedLinearParameters.pack(linears)
    projection = SharedInputProjection(pack.split_sizes, pack.current)
    events: list[tuple[int, bool | None]] = []

    def on_result(index: int, result: object) -> None:
        events.append((index, None if result is None else result.fused))  # type: ignore[attr-defined]

    follow_k = projection.follower_forward(1, linears[1].forward, on_result)
    follow_v = projection.follower_forward(2, linears[2].forward, on_result)
    x = torch.randn(2, 8)
    result = projection.compute(x, [m.forward for m in linears])
    projection.offer(x, result)
    k = follow_k(x)
    assert k.data_ptr() == result.outputs[1].data_ptr()  # the slice, not a recomputation
    other = torch.randn(2, 8)
    assert torch.equal(follow_v(other), linears[2](other))  # different input: runs itself
    assert torch.equal(follow_v(x), result.outputs[2])
    assert follow_k(x).data_ptr() != result.outputs[1].data_ptr()  # consumed: second call runs itself
    assert events == [(1, result.fused), (2, None), (2, result.fused), (1, None)]


def test_pending_slices_are_per_thread() -> None:
    linears = _linears(8, (8, 8), True, torch.float32, 4)
    pack = PackedLinearParameters.pack(linears)
    projection = SharedInputProjection(pack.split_sizes, pack.current)
    x = torch.randn(2, 8)
    projection.offer(x, projection.compute(x, [m.forward for m in linears]))
    seen: list[object] = []
    thread = threading.Thread(target=lambda: seen.append(projection.take(1, x)))
    thread.start()
    thread.join()
    assert seen == [None]
    assert projection.take(1, x) is not None


def test_outputs_equal_is_bitwise() -> None:
    a = torch.tensor([0.0, 1.0])
    assert outputs_equal((a,), (a.clone(),))
    assert not outputs_equal((a,), (torch.tensor([-0.0, 1.0]),))
    nan = torch.tensor([float("nan")])
    assert outputs_equal((nan,), (nan.clone(),))
    assert not outputs_equal((a,), (a.double(),))
    assert not outputs_equal((a,), (a, a))
