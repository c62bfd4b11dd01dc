"""Shared fixtures: a tiny seeded Wan transformer, fixed inputs and an independent model fingerprint.

They come from :mod:`worldfoundry.testing`, whose fingerprint does not use the lifecycle code under test
(``core/acceleration/snapshot.py``): it records every module's identity and instance attributes, the contents
of every parameter / buffer / child / hook dictionary, parameter identities, the state dict values and a
forward output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

from worldfoundry import testing

# Tiny tensors gain nothing from intra-op threads, and on a busy 2-core CI machine OpenMP synchronisation makes
# every small op many times slower. One thread keeps the suite fast and its results reproducible.
torch.set_num_threads(1)

TINY_WAN_CONFIG: dict[str, Any] = dict(testing.WAN_TINY)
ModelFingerprint = testing.ModelFingerprint
build_tiny_wan = testing.tiny_wan
fingerprint = testing.fingerprint
assert_same_model = testing.assert_same_model


def wan_inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    return testing.wan_inputs(seed=seed)


def wan_forward(model: nn.Module, inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    return testing.run_model(model, inputs or wan_inputs())


@pytest.fixture
def tiny_wan() -> nn.Module:
    return build_tiny_wan()


@pytest.fixture
def make_tiny_wan() -> Callable[..., nn.Module]:
    return build_tiny_wan


@pytest.fixture
def run_wan() -> Callable[..., torch.Tensor]:
    return wan_forward


@pytest.fixture
def model_fingerprint() -> Callable[..., ModelFingerprint]:
    return fingerprint


@pytest.fixture
def assert_restored() -> Callable[[ModelFingerprint, ModelFingerprint], None]:
    return assert_same_model
