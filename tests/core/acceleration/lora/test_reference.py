"""The torch reference of the FP32 adapter arithmetic: accuracy vs float64, chunking, the bf16×3 split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.lora.exact_fma import fma_fp32
from worldfoundry.core.acceleration.lora.reference import (
    RANK_TILE,
    compute_dtype_for,
    lora_down_reference,
    lora_linear_reference,
    lora_up_add_reference,
    padded_rank,
    rows_per_chunk,
    split_bf16x3,
)

U32 = 2.0**-24  # unit roundoff of FP32


def _bound(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """A rigorous-enough FP32 dot-product error bound: K · u · (|x| @ |A|ᵀ)."""
    return x.shape[1] * U32 * (x.double().abs() @ a.double().abs().T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_down_and_up_match_float64(dtype: torch.dtype) -> None:
    """Tolerances: t within K·u·(|x|@|A|ᵀ); y within half an ulp of the output dtype plus the FP32 error of the update."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(53, 96, generator=g).to(dtype)
    a = torch.randn(6, 96, generator=g) * 0.3
    b = torch.randn(40, 6, generator=g) * 0.3
    base = torch.randn(53, 40, generator=g).to(dtype)
    t = lora_down_reference(x, a)
    assert t.dtype == torch.float32 and t.shape == (53, 6)
    t64 = x.double() @ a.double().T
    assert ((t.double() - t64).abs() <= _bound(x, a)).all()
    y = lora_up_add_reference(base, t, b, -0.5)
    assert y.dtype == dtype and y.shape == base.shape
    y64 = base.double() - 0.5 * t64 @ b.double().T
    half_ulp = torch.finfo(dtype).eps / 2  # eps = 2**-mantissa_bits: half an ulp relative
    update_err = 0.5 * (_bound(x, a) @ b.double().abs().T + 8 * U32 * (t64.abs() @ b.double().abs().T))
    assert ((y.double() - y64).abs() <= half_ulp * y64.abs() + update_err + 1e-30).all()
    if dtype != torch.float32:  # one rounding only: almost every element is the correctly rounded value
        assert (y == y64.to(dtype)).float().mean() > 0.99


def test_float64_activations_compute_in_float64() -> None:
    assert compute_dtype_for(torch.float64) == torch.float64
    assert compute_dtype_for(torch.bfloat16) == compute_dtype_for(torch.float16) == torch.float32
    x = torch.randn(5, 7, dtype=torch.float64)
    a, b = torch.randn(2, 7), torch.randn(3, 2)
    base = torch.randn(5, 3, dtype=torch.float64)
    y = lora_linear_reference(x, base, a, b, 0.25)
    assert y.dtype == torch.float64
    assert torch.allclose(y, base + 0.25 * (x @ a.double().T) @ b.double().T, rtol=1e-14, atol=1e-14)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 70), chunk_rows=st.integers(1, 80), offset=st.integers(0, 4))
def test_chunking_only_changes_summation_order(rows: int, chunk_rows: int, offset: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 24, generator=g).to(torch.bfloat16)
    a = torch.randn(8, 24, generator=g)
    b = torch.randn(10, 4, generator=g)
    base = torch.randn(rows, 10, generator=g).to(torch.bfloat16)
    t_full = lora_down_reference(x, a)
    t_chunk = lora_down_reference(x, a, chunk_bytes=chunk_rows * 24 * 4)
    assert ((t_full.double() - t_chunk.double()).abs() <= 2 * _bound(x, a)).all()
    # the up step computes every row alone in a fixed order: chunking never changes a bit
    y_full = lora_up_add_reference(base, t_full, b, 0.7, offset=offset)
    y_chunk = lora_up_add_reference(base, t_full, b, 0.7, offset=offset, chunk_bytes=chunk_rows * 12 * 10 * 8)
    assert torch.equal(y_full, y_chunk)


def test_up_step_order_is_the_documented_one() -> None:
    """acc = t0·B0; acc = fma(tj, Bj, acc); y = round(fma(acc, scale, base)) — written out element by element."""
    import numpy as np

    g = torch.Generator().manual_seed(11)
    t = torch.randn(3, 5, generator=g)
    b = torch.randn(4, 5, generator=g)
    base = torch.randn(3, 4, generator=g).to(torch.bfloat16)
    y = lora_up_add_reference(base, t, b, 0.3)
    for i in range(3):
        for n in range(4):
            acc = np.float32(t[i, 0].item()) * np.float32(b[n, 0].item())
            for j in range(1, 5):
                acc = fma_fp32(t[i, j:j + 1], b[n, j:j + 1], torch.tensor([float(acc)]))[0].item()
            out = fma_fp32(torch.tensor([acc]), torch.tensor([0.3]), base[i, n:n + 1].float())
            assert torch.equal(y[i, n:n + 1], out.to(torch.bfloat16)), (i, n)


@pytest.mark.parametrize("ranks", [(8, 8, 8), (3, 20), (1,)])
def test_down_reference_columns_depend_only_on_their_tile(ranks: tuple[int, ...]) -> None:
    """Stacked on tile boundaries (zero rows between), each adapter's columns are bitwise its own result."""
    g = torch.Generator().manual_seed(sum(ranks))
    x = torch.randn(29, 40, generator=g).to(torch.bfloat16)
    parts = [torch.randn(r, 40, generator=g) for r in ranks]
    padded = [torch.cat([p, torch.zeros(padded_rank(p.shape[0]) - p.shape[0], 40)]) for p in parts]
    t = lora_down_reference(x, torch.cat(padded))
    offset = 0
    for p, q in zip(parts, padded):
        assert torch.equal(t[:, offset:offset + p.shape[0]], lora_down_reference(x, p))
        offset += q.shape[0]
    assert padded_rank(1) == padded_rank(RANK_TILE) == RANK_TILE and padded_rank(RANK_TILE + 1) == 2 * RANK_TILE


def test_rows_per_chunk_bounds_memory() -> None:
    assert rows_per_chunk(5376, 4, 64 << 20) == (64 << 20) // (5376 * 4)
    assert rows_per_chunk(10**9, 4, 1) == 1


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="do not match"):
        lora_down_reference(torch.zeros(3, 4), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="do not match"):
        lora_up_add_reference(torch.zeros(3, 4), torch.zeros(3, 2), torch.zeros(4, 2), 1.0, offset=1)
    with pytest.raises(ValueError, match="float32"):
        split_bf16x3(torch.zeros(2, dtype=torch.float64))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32),
                min_size=1, max_size=64))
def test_bf16x3_split_is_exact(values: list[float]) -> None:
    a = torch.tensor(values, dtype=torch.float32)
    parts = split_bf16x3(a)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, len(values))
    total = parts[0].float() + parts[1].float() + parts[2].float()
    normal = a.abs() >= 2.0**-110
    assert torch.equal(total[normal], a[normal])
    assert ((total - a).abs() <= 2.0**-133).all()
