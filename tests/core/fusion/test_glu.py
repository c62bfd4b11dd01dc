"""The gated-SiLU kernel (``h * silu(g)`` of SANA-Video's GLU feed-forward) vs its references (interpreter on CPU).

Under the interpreter the kernel's ``exp`` is numpy's float32 ``exp``, so it is compared bitwise with
:func:`~worldfoundry.core.fusion.glu.reference_silu_gate_formula` given numpy's ``exp``; that formula with torch's
``exp`` is in turn bitwise eager's ``h * F.silu(g)`` for bfloat16/float16 on the CPU (and for every dtype on CUDA:
``tests/core/fusion/test_glu_gpu.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.fusion import glu
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

needs_interpreter = pytest.mark.skipif(not (TRITON_AVAILABLE and interpreter_enabled()),
                                       reason="needs triton with TRITON_INTERPRET=1")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def numpy_exp(t: torch.Tensor) -> torch.Tensor:
    """The interpreter's float32 ``exp``."""
    return torch.from_numpy(np.exp(t.numpy()))


def _halves(shape: tuple[int, ...], dtype: torch.dtype, *, channels_last: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    return torch.chunk(x, 2, dim=1)


def _check(h: torch.Tensor, g: torch.Tensor, **kwargs) -> torch.Tensor:
    out = glu.silu_gate(h, g, **kwargs)
    eager = h * F.silu(g)
    assert out.stride() == eager.stride() and out.dtype == eager.dtype and out.shape == eager.shape
    assert torch.equal(out, glu.reference_silu_gate_formula(h, g, numpy_exp))
    return out


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("limit", [2**31 - 1, 5])
def test_chunked_halves_bitwise(dtype: torch.dtype, channels_last: bool, limit: int) -> None:
    h, g = _halves((3, 20, 5, 7), dtype, channels_last=channels_last)
    _check(h, g, index_limit=limit)
    key = next(k for k in glu._PLANS if k[2] == h.stride() and k[-1] == limit and k[0] == dtype)
    assert glu._PLANS[key][0]._kwargs["INDEX_64"] is (limit == 5)
    if channels_last:  # one row dimension: the pixels of every frame
        assert glu._PLANS[key][0]._kwargs["ROW_DIMS"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_formula_is_eager_silu_on_cpu(dtype: torch.dtype) -> None:
    h, g = _halves((2, 64, 9, 11), dtype, channels_last=True, seed=3)
    assert torch.equal(glu.reference_silu_gate_formula(h, g), glu.reference_silu_gate(h, g))


@needs_interpreter
def test_three_row_dimensions_and_transposed_halves() -> None:
    x = (torch.randn(4, 3, 10, 6) * 3).to(torch.bfloat16).permute(2, 0, 3, 1)  # [10, 4, 6, 3]
    h, g = x[:5], x[5:]
    _check(h, g)
    a, b = (torch.randn(2, 6, 5, 7) * 3).to(torch.bfloat16).transpose(-1, -2).chunk(2, dim=1)
    _check(a, b)


@needs_interpreter
def test_too_many_row_dimensions_raise_and_empty_and_scalar() -> None:
    h = torch.randn(2, 3, 4, 5, 6).permute(4, 2, 0, 3, 1)  # the halves' orders differ: no dimension merges
    g = torch.randn(6, 4, 2, 5, 3)
    with pytest.raises(ValueError, match="row dimensions"):
        glu.silu_gate(h, g)
    e = torch.empty(0, 4)
    assert glu.silu_gate(e, e).shape == (0, 4)
    one = torch.tensor([[1.5]])
    assert torch.equal(glu.silu_gate(one, one), glu.reference_silu_gate_formula(one, one, numpy_exp))


def test_reasons() -> None:
    a = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert glu.silu_gate_reason(a, a) is None
    assert "differ in dtype" in glu.silu_gate_reason(a, a.float())
    assert "float64" in glu.silu_gate_reason(a.double(), a.double())
    assert "shape" in glu.silu_gate_reason(a, a[:1])
    with pytest.raises(ValueError, match="use the reference"):
        glu.silu_gate(a.double(), a.double())


def test_collapse_merges_nested_strides() -> None:
    x = torch.empty(3, 20, 5, 7).to(memory_format=torch.channels_last)
    h, g = torch.chunk(x, 2, dim=1)
    out = glu.eager_strides(h, g)
    assert out == torch.empty(3, 10, 5, 7).to(memory_format=torch.channels_last).stride()
    dims = glu.collapse(tuple(h.shape), out, h.stride(), g.stride())
    assert dims == [(105, 10, (20, 20)), (10, 1, (1, 1))]
    assert glu.collapse((1, 1), (1, 1), (1, 1)) == [(1, 1, (0,))]


@needs_interpreter
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 9), hh=st.integers(1, 4), ww=st.integers(1, 5),
       layout=st.sampled_from(["contiguous", "channels_last", "transposed"]), dim=st.integers(1, 3),
       dtype=st.sampled_from(DTYPES), limit=st.sampled_from([2**31 - 1, 7]), seed=st.integers(0, 2**16))
def test_any_layout_matches_reference_and_eager_strides(n: int, c: int, hh: int, ww: int, layout: str, dim: int,
                                                        dtype: torch.dtype, limit: int, seed: int) -> None:
    shape = [n, c, hh, ww]
    shape[dim] *= 2
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.transpose(0, 2).contiguous().transpose(0, 2)
    h, gate = torch.chunk(x, 2, dim=dim)
    _check(h, gate, index_limit=limit)
