"""The ``Example:`` sections of the plugin authors' modules run as written (doctest)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = (
    "worldfoundry.plugin",
    "worldfoundry.core.acceleration.options",
    "worldfoundry.core.timing",
    "worldfoundry.testing",
    "worldfoundry_resident_blocks.residency_files",
    "worldfoundry_easycache.options",
    "worldfoundry_lightvae.options",
    "worldfoundry_optimized_mha.options",
    "worldfoundry_resident_blocks.options",
    "worldfoundry_selective_fp8.options",
    "worldfoundry_example_gelu_tanh.options",
    "worldfoundry.core.model_loading.policy",
)


@pytest.mark.parametrize("name", MODULES)
def test_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0, f"{name}: {result.failed} example(s) failed"
