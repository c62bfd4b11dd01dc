"""Property: whatever min_tokens and step range, every routed SDPA call is counted exactly once — as a provider
call or as a fallback with its reason — and the output stays within the exact-equivalent tolerance."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations

TEST_PROVIDER = "chunked_softmax"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 40), st.integers(0, 40), st.integers(0, 3), st.integers(0, 3), st.integers(0, 3))
def test_every_call_is_counted_once(wan_case, registry, self_min: int, cross_min: int, first: int, last: int,
                                    step: int) -> None:  # noqa: ANN001
    dense = wan_case.run()
    spec = {"attention_policy": {
        "self": {"backend": TEST_PROVIDER, "min_tokens": self_min, "dense_first_steps": first, "dense_last_steps": last},
        "text_cross": {"backend": TEST_PROVIDER, "min_tokens": cross_min}}}
    session = install_diffusion_accelerations(wan_case.model, spec, registry=registry)
    try:
        with request_scope(RequestContext("r", step_index=step, num_steps=4)):
            out = wan_case.run()
        record = session.execution_report()["plugins"]["attention_policy"]["model"]["requests"]["r"]
        counters = record["counters"]
        assert counters.get(TEST_PROVIDER, 0) + counters.get("dense_fallback", 0) == 4
        self_runs = 32 >= self_min and not (step < first or (last and step >= 4 - last))
        cross_runs = 24 >= cross_min
        assert counters.get(TEST_PROVIDER, 0) == 2 * self_runs + 2 * cross_runs
        torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-5)
    finally:
        session.uninstall()
    assert torch.equal(wan_case.run(), dense)
