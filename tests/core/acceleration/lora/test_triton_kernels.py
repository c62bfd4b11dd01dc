"""Triton kernels vs the torch reference (``TRITON_INTERPRET=1`` on the CPU, natively on CUDA when present)."""

from __future__ import annotations

import os

import pytest
import torch

from worldfoundry.core.acceleration.lora.reference import (
    lora_down_reference,
    lora_up_add_reference,
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
@pytest.mark.parametrize(("rows", "out", "rank", "offset"), [(37, 50, 8, 8), (3, 7, 1, 0), (40, 96, 16, 4)])
def test_up_add_kernel_matches_reference(dtype: torch.dtype, rows: int, out: int, rank: int, offset: int) -> None:
    """Tolerance: the FP32 sums differ only in the order of the rank terms: within one ulp of the output dtype
    plus 2·R·u·|scale|·(|t|@|B|ᵀ); for 16-bit outputs most elements are bitwise equal."""
    g = torch.Generator().manual_seed(rows + out)
    t = torch.randn(rows, offset + rank + 3, generator=g).to(DEVICE)
    b = (torch.randn(out, rank, generator=g) * 0.3).to(DEVICE)
    base = torch.randn(rows, out, generator=g).to(dtype).to(DEVICE)
    y = lora_up_add_triton(base, t, b, -0.75, offset=offset, config=SMALL_UP)
    ref = lora_up_add_reference(base, t, b, -0.75, offset=offset)
    assert y.dtype == dtype and y.shape == base.shape
    used = t[:, offset:offset + rank].double().abs()
    bound = torch.finfo(dtype).eps * ref.double().abs() + 2 * rank * U32 * 0.75 * (used @ b.double().abs().T)
    assert ((y.double() - ref.double()).abs() <= bound).all()
    if dtype != torch.float32:  # the final rounding hides the order of the FP32 sums almost always
        assert (y == ref).float().mean() > 0.9


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
