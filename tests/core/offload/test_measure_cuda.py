"""On CUDA, a block's compute time is its device time, not the pace at which the host launches it."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from worldfoundry.core.offload.measure import time_block_compute

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class SlowToLaunch(nn.Module):
    """2 ms of host time per call around a few microseconds of device work."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return x * 2.0


def test_primed_samples_measure_device_time() -> None:
    device = torch.device("cuda")
    timing = time_block_compute(SlowToLaunch(), lambda: {"x": torch.ones(1024, device=device)}, device=device,
                                warmup=1, samples=8)
    assert timing.timer == "cuda_events_primed"
    assert timing.median_ms < 0.5  # unprimed, every sample would wait for the host: about 2 ms per call
