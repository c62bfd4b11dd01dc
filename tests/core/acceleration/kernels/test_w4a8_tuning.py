"""Tile choice of the W4A8 GEMMs (:mod:`worldfoundry.core.acceleration.kernels.w4a8_tuning`): the committed table's
entries are valid tiles of their kernel, a measured entry is used without timing and cached per ``M`` bucket, and
the per-channel candidates all divide the W81 FFN ``K``. (Timing itself runs on CUDA; the benchmark checks that the
choice is within 3 % of the fastest swept tile.)"""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.kernels import w4a8_tuning
from worldfoundry.core.acceleration.kernels.int8_act_quant import TRITON_AVAILABLE

pytestmark = pytest.mark.skipif(not TRITON_AVAILABLE, reason="needs triton")


def test_measured_entries_are_tiles_of_their_kernel():
    from worldfoundry.core.acceleration.kernels.w4a8_gemm import W4A8_CONFIGS

    grouped = [{k: v for k, v in c.items()} for c in W4A8_CONFIGS]
    for (cap, kernel, group, n, k), cfg in w4a8_tuning.MEASURED_CONFIGS.items():
        assert cap == (9, 0) and kernel in ("w4a8", "w4a8_channel") and k % 128 == 0 and n % 64 == 0
        assert cfg in grouped if kernel == "w4a8" else cfg["BLOCK_K"] in (128, 256)
        assert group in (64, 128) if kernel == "w4a8" else group == 0


def test_a_measured_tile_is_used_without_timing_and_cached(monkeypatch):
    monkeypatch.setattr(w4a8_tuning, "_CHOSEN", {})
    launched = []
    key = ("w4a8", 128, 8960, 1536, True, True, True)
    measured = {"BLOCK_M": 64, "BLOCK_N": 64}
    got = w4a8_tuning.choose_config(key, torch.device("cpu"), 32760, [{"BLOCK_M": 1}], launched.append, measured)
    assert got == measured and launched == []  # nothing launched: the table decides
    assert w4a8_tuning.chosen_config(torch.device("cpu"), key, 20000) == measured  # same power-of-two bucket
    assert w4a8_tuning.chosen_config(torch.device("cpu"), key, 70000) is None


def test_channel_candidates_divide_the_w81_ffn_widths():
    from worldfoundry.core.acceleration.kernels.w4a8_channel_gemm import CHANNEL_CONFIGS, channel_candidates

    assert channel_candidates(1536) == CHANNEL_CONFIGS and channel_candidates(8960) == CHANNEL_CONFIGS
    assert all(c["BLOCK_K"] == 128 for c in channel_candidates(384))
