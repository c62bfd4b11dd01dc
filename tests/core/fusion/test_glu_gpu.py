"""The glu kernel on CUDA: bitwise eager ``h * F.silu(g)`` with eager's strides, at the SANA-Video 480p shape, in
every dtype, on contiguous and transposed halves, and past ``2**31`` elements. Skipped without CUDA and triton."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worldfoundry.core.fusion import glu
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE) or interpreter_enabled(),
                                 reason="needs CUDA + triton, without TRITON_INTERPRET")]
#: ``conv_depth``'s output of the default SANA-Video feed-forward at latent 21x60x104 (30x52 tokens per frame)
SANA_480P = (21, 11200, 30, 52)


def _halves(shape: tuple[int, ...], dtype: torch.dtype, channels_last: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(shape, device="cuda", generator=g) * 4).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return torch.chunk(x, 2, dim=1)


def _bitwise(h: torch.Tensor, g: torch.Tensor) -> None:
    with torch.inference_mode():
        eager = h * F.silu(g)
        out = glu.silu_gate(h, g)
    assert out.stride() == eager.stride()
    assert torch.equal(out, eager), int((out != eager).sum())


@pytest.mark.parametrize("channels_last", [True, False])
def test_sana_480p_halves_bitwise(channels_last: bool) -> None:
    h, g = _halves(SANA_480P, torch.bfloat16, channels_last)
    _bitwise(h, g)
    assert glu.reference_silu_gate_formula(h, g).stride() == (h * F.silu(g)).stride()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_dtype_and_special_values(dtype: torch.dtype) -> None:
    h, g = _halves((4, 2048, 16, 24), dtype, True, seed=1)
    _bitwise(h, g)
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 88.0, -88.0, 100.0, -100.0, float("inf"), float("-inf"),
                            float("nan"), 3.0], device="cuda").to(dtype)
    x = special.reshape(1, 12, 1, 1).repeat(2, 2, 3, 1)  # every value meets every value
    a, b = torch.chunk(x.contiguous(memory_format=torch.channels_last), 2, dim=1)
    for hh, gg in ((a, b), (b, a), (a, a.flip(1))):
        with torch.inference_mode():
            eager, out = hh * F.silu(gg), glu.silu_gate(hh, gg)
        assert torch.equal(out.isnan(), eager.isnan())
        assert torch.equal(out.nan_to_num(), eager.nan_to_num())


def test_transposed_and_three_row_dimension_halves() -> None:
    x = (torch.randn(64, 48, 3, 40, device="cuda") * 3).bfloat16().permute(2, 0, 3, 1)
    _bitwise(x[:1], x[1:2])
    a, b = (torch.randn(8, 256, 24, 40, device="cuda") * 3).bfloat16().transpose(-1, -2).chunk(2, dim=1)
    _bitwise(a, b)


def test_past_2_31_elements_takes_the_64_bit_path() -> None:
    # 3.6e9 elements: each half holds 1.8e9 but reaches past 2**31
    h, g = _halves((2, 11200, 400, 400), torch.bfloat16, True)
    glu._PLANS.clear()
    _bitwise(h, g)
    plan = next(iter(glu._PLANS.values()))[0]
    assert plan._kwargs["INDEX_64"] is True
    del h, g
    torch.cuda.empty_cache()
