"""TensorIterator's output strides, reproduced from operand strides, vs the strides eager ops really produce."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.fusion import layout


def _view(shape: list[int], order: list[int], steps: list[int], seed: int) -> torch.Tensor:
    """A ``shape`` view with its dimensions laid out in ``order`` and strided by ``steps``."""
    g = torch.Generator().manual_seed(seed)
    base_shape = [shape[d] * steps[d] for d in order]
    base = torch.randn(base_shape, generator=g).permute([order.index(d) for d in range(len(shape))])
    return base[tuple(slice(None, None, steps[d]) for d in range(len(shape)))]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), nd=st.integers(0, 5))
def test_elementwise_strides_match_eager(data: st.DataObject, nd: int) -> None:
    shape = data.draw(st.lists(st.integers(0, 3), min_size=nd, max_size=nd))
    views = []
    for i in range(data.draw(st.integers(1, 2))):
        order = data.draw(st.permutations(list(range(nd))))
        steps = data.draw(st.lists(st.sampled_from([1, 1, 2]), min_size=nd, max_size=nd))
        views.append(_view(shape, order, steps, i))
    expected = (views[0] * views[1] if len(views) == 2 else F.silu(views[0])).stride()
    assert layout.elementwise_strides(shape, [v.stride() for v in views]) == expected


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_chunk_halves_and_predicates(memory_format: torch.memory_format) -> None:
    x = torch.randn(2, 8, 1, 5).to(memory_format=memory_format)
    h, g = x.chunk(2, dim=1)
    s = F.silu(g)
    assert layout.elementwise_strides(g.shape, [g.stride()]) == s.stride()
    assert layout.elementwise_strides(h.shape, [h.stride(), s.stride()]) == (h * s).stride()
    for t in (x, h, s):
        assert layout.is_contiguous(t.shape, t.stride()) == t.is_contiguous()
        assert layout.is_channels_last(t.shape, t.stride()) == t.is_contiguous(memory_format=torch.channels_last)
    assert layout.channels_last_strides((2, 4, 1, 5)) == torch.empty(2, 4, 1, 5,
                                                                     memory_format=torch.channels_last).stride()
