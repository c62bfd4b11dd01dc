"""Quality metrics: the float64 torch SSIM is scikit-image's, identical frames take the shortcut to exactly what
scikit-image returns for them, and the CUDA path (where present) agrees with the host's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from skimage.metrics import structural_similarity

from worldfoundry.bench.metrics import frame_ssim, psnr, quality, ssim_torch


def _pair(shape: tuple[int, ...], noise: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = (rng.random(shape) * 255).astype(np.uint8)
    b = np.clip(a.astype(np.int64) + rng.integers(-noise, noise + 1, shape), 0, 255).astype(np.uint8)
    return a, b


@settings(max_examples=30, deadline=None)
@given(h=st.integers(7, 40), w=st.integers(7, 40), noise=st.integers(0, 60), seed=st.integers(0, 10_000))
def test_torch_ssim_is_scikit_image_ssim(h: int, w: int, noise: int, seed: int) -> None:
    a, b = _pair((h, w, 3), noise, seed)
    expected = structural_similarity(a, b, channel_axis=-1, data_range=255, win_size=7)
    assert abs(ssim_torch(a, b, 7) - expected) < 1e-9


@pytest.mark.parametrize("win", [3, 5])
def test_small_windows_match_too(win: int) -> None:
    a, b = _pair((6, 9, 3), 30, seed=win)
    expected = structural_similarity(a, b, channel_axis=-1, data_range=255, win_size=win)
    assert abs(ssim_torch(a, b, win) - expected) < 1e-9


def test_identical_frames_get_exactly_what_scikit_image_gives() -> None:
    a, b = _pair((3, 16, 24, 3), 40, seed=1)
    b[1] = a[1]  # one frame of three is identical
    got = frame_ssim(a, b)
    expected = [float(structural_similarity(x, y, channel_axis=-1, data_range=255, win_size=7)) for x, y in zip(a, b)]
    assert got == expected and got[1] == 1.0
    assert psnr(a, a.copy()) == math.inf
    assert math.isfinite(psnr(a, b))


def test_quality_reports_the_same_on_the_host_and_refuses_mismatched_frames() -> None:
    a, b = _pair((2, 16, 16, 3), 25, seed=3)
    lat = torch.zeros(1, 4, 2, 2)
    q = quality(lat + 1.0, lat + 1.0, a, b)
    assert q["min_ssim"] == min(q["ssim_per_frame"]) and q["bitwise_equal"] is True
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    assert q["psnr_db"] == pytest.approx(10 * math.log10(255.0**2 / mse), abs=1e-12)
    with pytest.raises(ValueError, match="frame shapes differ"):
        frame_ssim(a, b[:, :8])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_metrics_agree_with_the_host() -> None:
    a, b = _pair((4, 320, 576, 3), 12, seed=7)
    host = frame_ssim(a, b)
    cuda = frame_ssim(a, b, device="cuda")
    assert max(abs(x - y) for x, y in zip(host, cuda)) < 1e-9
    assert psnr(a, b, device="cuda") == pytest.approx(psnr(a, b), abs=1e-9)
    lat = torch.zeros(1, 4, 2, 2, device="cuda")
    q = quality(lat, lat, a, b)
    assert max(abs(x - y) for x, y in zip(q["ssim_per_frame"], host)) < 1e-9
