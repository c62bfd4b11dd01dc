"""Every registered plugin's options under random JSON-like input: valid options or a typed error, nothing else.

``Options.from_mapping`` must return the plugin's options or raise :class:`AccelerationOptionsError` (never a
``TypeError``, ``OverflowError``, ``RecursionError``, ...); installing the same spec on a tiny model must either
install (then uninstall) or raise a :class:`WorldFoundryError`, and leave the model exactly as it was.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worldfoundry import testing
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import AccelerationOptionsError, WorldFoundryError

REGISTRY = AccelerationRegistry(discover=True)
NAMES = tuple(name for name in REGISTRY.names() if REGISTRY.get(name).options is not None)

SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["", "auto", "qkv", "kv", "none", "torch", "rowwise", "cond", "x.pt",
                                          "blocks.*.ffn.net.2", "\x00", "-1"]),
)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                    max_leaves=12)


def _spec(name: str) -> st.SearchStrategy[Any]:
    """Mappings over the plugin's own keys (and some unknown ones), or any JSON-like value."""
    options = REGISTRY.get(name).options
    known = list(getattr(options, "known_options", lambda: ())()) or ["self", "cross"]
    keys = st.one_of(st.sampled_from(known + ["self", "cross"]), st.text(max_size=6))
    return st.one_of(st.dictionaries(keys, JSON, max_size=4), JSON)


def _from_mapping(name: str, spec: Any) -> Any:
    try:
        return REGISTRY.get(name).options.from_mapping(spec)
    except AccelerationOptionsError as exc:
        assert exc.plugin and str(exc) and len(str(exc)) < 2000
        return None


def test_every_built_in_plugin_publishes_its_options() -> None:
    assert {"attention_lora", "easycache", "example_gelu_tanh", "lightvae", "optimized_mha", "resident_blocks",
            "selective_fp8", "wan_cross_kv_fusion"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_random_options_give_options_or_a_typed_error(name: str) -> None:
    options = REGISTRY.get(name).options

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(spec=_spec(name))
    def check(spec: Any) -> None:
        result = _from_mapping(name, spec)
        if result is not None:
            assert isinstance(result, options)
            json.dumps(result.to_json(), allow_nan=True)  # the receipt form is JSON

    check()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("huge", [10**400, -(10**400), math.inf, 1e308, "x" * 10_000])
def test_huge_values_are_typed_errors(name: str, huge: Any) -> None:
    options = REGISTRY.get(name).options
    for key in getattr(options, "known_options", lambda: ())():
        _from_mapping(name, {key: huge})


@pytest.mark.parametrize("name", NAMES)
def test_random_specs_leave_the_model_unchanged(name: str) -> None:
    model = testing.guarded(testing.tiny_wan(num_layers=1))  # the loader's guard stays by design
    before = testing.fingerprint(model, forward=False)
    policy = RuntimePolicy()

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(spec=_spec(name))
    def check(spec: Any) -> None:
        try:
            session = install_diffusion_accelerations(model, {name: spec}, policy, registry=REGISTRY)
        except WorldFoundryError:
            pass
        else:
            session.uninstall()
        testing.assert_restored(model, before)

    check()
