"""Options of ``attention_policy``: spec keys, shorthands, typed errors with JSON paths."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from worldfoundry_attention_policy.options import Options, TypePolicy

from worldfoundry.errors import AccelerationOptionsError

PATH = "accelerations.attention_policy"


def test_full_spec_round_trips_through_to_json() -> None:
    spec = {"self": {"backend": "fa3", "min_tokens": 8192, "dense_first_steps": 1, "dense_last_steps": 2},
            "text_cross": "sdpa", "image_cross": {"backend": "sdpa_cudnn"}, "on_unavailable": "fallback"}
    opts = Options.from_mapping(spec, path=PATH)
    assert opts.self_attention == TypePolicy("fa3", 8192, 1, 2)
    assert opts.text_cross == TypePolicy("sdpa") and not opts.text_cross.routed
    assert set(opts.routed()) == {"self", "image_cross"}
    out = opts.to_json()
    assert out["self"] == {"backend": "fa3", "min_tokens": 8192, "dense_first_steps": 1, "dense_last_steps": 2}
    assert out["on_unavailable"] == "fallback"
    assert Options.from_mapping({k: v for k, v in out.items() if v is not None}) == opts


def test_cross_shorthand_sets_both_cross_types() -> None:
    opts = Options.from_mapping({"cross": {"backend": "sdpa_math", "min_tokens": 4}})
    assert opts.text_cross == opts.image_cross == TypePolicy("sdpa_math", 4)
    assert opts.cross_shorthand and opts.self_attention is None


@pytest.mark.parametrize(("spec", "path", "fragment"), [
    ({}, f"{PATH}.self", "nothing selected"),
    ({"self": "sdpa", "cross": "sdpa"}, f"{PATH}.self", "nothing selected"),
    ({"selfie": "fa3"}, PATH, "unknown option(s) ['selfie']"),
    ({"self": {"backend": "fa3", "tau": 1.0}}, f"{PATH}.self", "unknown option(s) ['tau']"),
    ({"self": {"backend": "fa3", "min_tokens": -1}}, f"{PATH}.self.min_tokens", "expected an integer in [0,"),
    ({"self": {"backend": "fa3", "min_tokens": True}}, f"{PATH}.self.min_tokens", "expected an integer"),
    ({"self": {"backend": "fa3", "dense_last_steps": 10**9}}, f"{PATH}.self.dense_last_steps", "100000"),
    ({"self": {"backend": "fa 3"}}, f"{PATH}.self.backend", "expected a provider name"),
    ({"self": {"backend": ""}}, f"{PATH}.self.backend", "non-empty string"),
    ({"self": 3}, f"{PATH}.self", "expected a mapping"),
    ({"self": "fa3", "on_unavailable": "ignore"}, f"{PATH}.on_unavailable", "one of ['error', 'fallback']"),
    ({"cross": "fa3", "text_cross": "sage"}, f"{PATH}.cross", "not both"),
])
def test_bad_options_name_the_path(spec: dict, path: str, fragment: str) -> None:
    with pytest.raises(AccelerationOptionsError) as info:
        Options.from_mapping(spec, path=PATH)
    assert info.value.path == path
    assert fragment in str(info.value) and str(info.value).startswith("attention_policy: ")


def test_not_a_mapping() -> None:
    with pytest.raises(AccelerationOptionsError, match="expected a mapping of options, got list"):
        Options.from_mapping(["self"])


@given(st.integers(min_value=0, max_value=2**31 - 1), st.integers(min_value=0, max_value=100_000))
def test_any_bounded_numbers_are_kept(min_tokens: int, steps: int) -> None:
    opts = Options.from_mapping({"self": {"backend": "x", "min_tokens": min_tokens, "dense_first_steps": steps}})
    assert opts.self_attention.min_tokens == min_tokens and opts.self_attention.dense_first_steps == steps
