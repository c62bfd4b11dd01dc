"""Triton kernels vs the torch reference (``TRITON_INTERPRET=1`` on the CPU, natively on CUDA when present)."""

from __future__ import annotations

import os

import pytest
import torch

from worldfoundry.core.acceleration.lora.adapter import stack_down_groups
from worldfoundry.core.acceleration.lora.reference import (
    lora_down_reference,
    lora_up_add_reference,
    padded_rank,
    split_bf16x3,
)
from worldfoundry.core.acceleration.lora.triton_kernels import (
    HAS_TRITON,
    KERNEL_MAX_RANK,
    DownConfig,
    UpConfig,
    lora_down_triton,
    lora_up_add_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton with CUDA, or TRITON_INTERPRET=1",
)
SMALL_DOWN = DownConfig(block_m=16, block_k=32)
SMALL_UP = UpConfig(block_m=16, block_n=32)
U32 = 2.0**-24


def _down_bound(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return x.shape[1] * U32 * (x.double().abs() @ a.double().abs().T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "features", "rank"), [(37, 100, 8), (5, 33, 1), (64, 64, 24), (17, 40, 70)])
def test_down_kernel_matches_reference(dtype: torch.dtype, rows: int, features: int, rank: int) -> None:
    """Tolerance: both within K·u·(|x|@|A|ᵀ) of float64 (FP32 accumulation, different order)."""
    g = torch.Generator().manual_seed(rows * rank)
    x = torch.randn(rows, features, generator=g).to(dtype).to(DEVICE)
    a = (torch.randn(rank, features, generator=g) * 0.2).to(DEVICE)
    t = lora_down_triton(x, a, split_bf16x3(a), config=SMALL_DOWN)
    ref = lora_down_reference(x, a)
    t64 = x.double() @ a.double().T
    bound = _down_bound(x, a)
    assert t.dtype == torch.float32 and t.shape == (rows, rank)
    assert ((t.double() - t64).abs() <= bound).all()
    assert ((ref.double() - t64).abs() <= bound).all()


def test_down_kernel_strided_rows_and_empty_input() -> None:
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(20, 80, generator=g).to(torch.bfloat16).to(DEVICE)
    x = wide[:, :48]  # row stride 80, unit feature stride
    a = torch.randn(8, 48, generator=g).to(DEVICE)
    t = lora_down_triton(x, a, split_bf16x3(a), config=SMALL_DOWN)
    assert ((t.double() - x.double() @ a.double().T).abs() <= _down_bound(x, a)).all()
    assert lora_down_triton(x[:0], a, split_bf16x3(a)).shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "features", "ranks"), [(37, 100, (8, 8, 8)), (20, 48, (3, 16, 21)), (9, 40, (1, 40))])
def test_stacked_down_columns_equal_separate_launches(dtype: torch.dtype, rows: int, features: int,
                                                      ranks: tuple[int, ...]) -> None:
    """Adapters stacked on tile boundaries: each one's columns are bitwise its own launch's result, also when it
    is computed from a row view of the stack (the hand-over's own-columns fallback)."""
    g = torch.Generator().manual_seed(rows + features)
    x = torch.randn(rows, features, generator=g).to(dtype).to(DEVICE)
    parts = [torch.randn(r, features, generator=g) * 0.2 for r in ranks]
    (stacked, offsets), = stack_down_groups([(str(i), p) for i, p in enumerate(parts)])
    stacked = stacked.to(DEVICE)
    stacked3 = split_bf16x3(stacked)
    t = lora_down_triton(x, stacked, stacked3, config=SMALL_DOWN)
    for i, part in enumerate(parts):
        part = part.to(DEVICE)
        alone = lora_down_triton(x, part, split_bf16x3(part), config=SMALL_DOWN)
        off, rank = offsets[str(i)], part.shape[0]
        assert torch.equal(t[:, off:off + rank], alone), i
        rows_of = slice(off, off + padded_rank(rank))
        own = lora_down_triton(x, stacked[rows_of], stacked3[:, rows_of], config=SMALL_DOWN)
        assert torch.equal(own[:, :rank], alone), i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "out", "rank", "offset"), [(37, 50, 8, 8), (3, 7, 1, 0), (40, 96, 16, 4), (17, 130, 24, 0)])
@pytest.mark.parametrize("scale", [-1.0, 0.3701])
def test_up_add_kernel_is_bitwise_the_reference(dtype: torch.dtype, rows: int, out: int, rank: int, offset: int,
                                                scale: float) -> None:
    """Same operations in the same order (products and sums rounded as the reference rounds them)."""
    g = torch.Generator().manual_seed(rows + out)
    t = torch.randn(rows, offset + rank + 3, generator=g).to(DEVICE)
    b = (torch.randn(out, rank, generator=g) * 0.3).to(DEVICE)
    base = torch.randn(rows, out, generator=g).to(dtype).to(DEVICE)
    ref = lora_up_add_reference(base, t, b, scale, offset=offset)
    for config in (SMALL_UP, UpConfig(block_m=8, block_n=64, num_warps=2), None):  # None: default_up_config
        for b_layout in (b, b.t().contiguous().t()):  # row-major B and the Bᵀ view the adapter keeps
            y = lora_up_add_triton(base, t, b_layout, scale, offset=offset, config=config)
            assert y.dtype == dtype and y.shape == base.shape
            assert torch.equal(y, ref), (config, b_layout.stride())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf × masked-out zero lanes
def test_bf16_rounding_is_round_to_nearest_even() -> None:
    """With rank 1, t = 1, B = v and base = 0 the kernel's output is its rounding of v: compare with torch."""
    lows = torch.tensor([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    highs = torch.tensor([0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x7F7F, 0xFF7F, 0x0001, 0x8080], dtype=torch.int64)
    bits = (highs[:, None] * 65536 + lows[None, :]).reshape(-1)
    values = torch.from_numpy(bits.numpy().astype("uint32").view("float32")).clone()
    values = torch.cat([values, torch.tensor([0.0, 3.4e38, -3.4e38, 1e-40, float("inf"), -float("inf")])])
    b = values[:, None].to(DEVICE)
    t = torch.ones(1, 1, device=DEVICE)
    base = torch.zeros(1, values.numel(), dtype=torch.bfloat16, device=DEVICE)
    y = lora_up_add_triton(base, t, b, 1.0, config=SMALL_UP)[0].cpu()
    assert torch.equal(y.view(torch.int16), values.to(torch.bfloat16).view(torch.int16)), (y, values.to(torch.bfloat16))


def test_argument_checks() -> None:
    x = torch.zeros(4, 8, dtype=torch.bfloat16, device=DEVICE)
    a = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="do not match"):
        lora_down_triton(x, torch.zeros(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="unsupported dtypes"):
        lora_down_triton(x.double(), a)
    with pytest.raises(ValueError, match="unit stride"):
        lora_down_triton(torch.zeros(8, 4, dtype=torch.bfloat16, device=DEVICE).T, a)
    with pytest.raises(ValueError, match="exceeds"):
        lora_down_triton(x, torch.zeros(KERNEL_MAX_RANK + 1, 8, device=DEVICE))
    with pytest.raises(ValueError, match="split_bf16x3"):
        lora_down_triton(x, a, torch.zeros(3, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="do not match"):
        lora_up_add_triton(torch.zeros(4, 5, device=DEVICE), torch.zeros(4, 2, device=DEVICE),
                           torch.zeros(5, 2, device=DEVICE), 1.0, offset=1)
    with pytest.raises(ValueError, match="unsupported dtypes"):
        lora_up_add_triton(torch.zeros(4, 5, dtype=torch.float64, device=DEVICE), torch.zeros(4, 2, device=DEVICE),
                           torch.zeros(5, 2, device=DEVICE), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_full_size_shapes_are_bitwise() -> None:
    """At the H3/Wan widths with the default launch configurations: Q/K/V stacked down columns equal separate
    launches, the up kernel equals the reference (16,384 rows would take long in the reference; 1,024 suffice)."""
    g = torch.Generator().manual_seed(7)
    for features, out in ((5376, 7168), (1536, 1536)):
        x = torch.randn(1024, features, generator=g).to(torch.bfloat16).cuda()
        parts = [torch.randn(8, features, generator=g) / features**0.5 for _ in range(3)]
        (stacked, offsets), = stack_down_groups([(n, p) for n, p in zip("qkv", parts)])
        stacked = stacked.cuda()
        t = lora_down_triton(x, stacked, split_bf16x3(stacked))
        for n, part in zip("qkv", parts):
            part = part.cuda()
            assert torch.equal(t[:, offsets[n]:offsets[n] + 8], lora_down_triton(x, part, split_bf16x3(part))), n
        base = torch.randn(1024, out, generator=g).to(torch.bfloat16).cuda()
        bt = (torch.randn(8, out, generator=g) * 0.05).cuda()
        for scale in (-1.0, 0.37):
            y = lora_up_add_triton(base, t, bt.t(), scale, offset=offsets["k"])
            assert torch.equal(y, lora_up_add_reference(base, t, bt.t(), scale, offset=offsets["k"])), (features, scale)
