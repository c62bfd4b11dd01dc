"""The ``sage`` provider on the CPU: registration through the entry point, declared capabilities, the probe."""

from __future__ import annotations

import pytest
import torch
from worldfoundry_attention_sage.provider import installed_version

from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV
from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry


@pytest.fixture
def sage(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)
    return AttentionProviderRegistry(allowlist=["sage"]).get("sage")


def test_registered_as_approximate(sage) -> None:  # noqa: ANN001
    assert sage.numerics == "approximate" and sage.approximate
    assert sage.head_dims == (64, 96, 128) and sage.min_compute_capability == (8, 0)
    assert sage.version == installed_version()


def test_probe_on_the_cpu(sage) -> None:  # noqa: ANN001
    assert sage.probe("cpu", torch.bfloat16, 128) == "sage runs on ['cuda'], not cpu"
    q = torch.randn(1, 2, 8, 80)
    assert sage.check_call(q, q, q) == "device cpu not supported"
