"""The ``fa3`` provider on the CPU: registration through the entry point, declared capabilities and the probe's
checks (device, torch version, the wheel's build flags). The kernel itself runs in ``test_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from worldfoundry_attention_fa3.provider import HEAD_DIMS, build_flag_reason, torch_version_reason

from worldfoundry.core.acceleration.registry import PLUGIN_ALLOWLIST_ENV
from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry

#: the build flags fa3-fwd 0.0.3 ships in fa3_fwd_config.CONFIG (the ones that matter here)
FA3_FWD_003_FLAGS = {"build_flags": {"FLASHATTENTION_DISABLE_FP16": True, "FLASHATTENTION_DISABLE_HDIM64": False,
                                     "FLASHATTENTION_DISABLE_HDIM96": False, "FLASHATTENTION_DISABLE_HDIM128": False,
                                     "FLASHATTENTION_DISABLE_HDIM192": False, "FLASHATTENTION_DISABLE_HDIM256": False}}


@pytest.fixture
def fa3(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.delenv(PLUGIN_ALLOWLIST_ENV, raising=False)
    return AttentionProviderRegistry(allowlist=["fa3"]).get("fa3")


def test_registered_through_the_entry_point_with_its_capabilities(fa3) -> None:  # noqa: ANN001
    assert fa3.numerics == "exact_equivalent" and fa3.distribution == "worldfoundry-attention-fa3"
    assert fa3.dtypes == (torch.bfloat16, torch.float16) and fa3.min_compute_capability == (9, 0)
    assert fa3.head_dims == HEAD_DIMS and HEAD_DIMS[0] == 8 and HEAD_DIMS[-1] == 256 and 128 in HEAD_DIMS
    assert fa3.masks == frozenset({"none", "causal"}) and not fa3.supports_dropout


def test_probe_on_the_cpu(fa3) -> None:  # noqa: ANN001
    assert fa3.probe("cpu", torch.bfloat16, 128) == "fa3 runs on ['cuda'], not cpu"
    assert fa3.probe("cpu", torch.float32, 128) == "fa3 runs on ['cuda'], not cpu"


def test_per_call_checks(fa3) -> None:  # noqa: ANN001
    q = torch.randn(1, 2, 8, 128, dtype=torch.bfloat16)
    assert fa3.check_call(q.float(), q.float(), q.float()) == "device cpu not supported"


def test_torch_version_check() -> None:
    assert torch_version_reason("2.9.1") == "fa3-fwd needs torch >= 2.10, found 2.9.1"
    assert torch_version_reason("2.10.0") is None and torch_version_reason("2.11.0+cu130") is None
    assert torch_version_reason("3.0.0a0") is None


def test_build_flags_of_the_wheel() -> None:
    assert build_flag_reason(FA3_FWD_003_FLAGS, torch.bfloat16, 128) is None
    assert "built without fp16 kernels" in build_flag_reason(FA3_FWD_003_FLAGS, torch.float16, 128)
    assert build_flag_reason(FA3_FWD_003_FLAGS, torch.bfloat16, 264) == \
        "FlashAttention-3 supports head sizes up to 256, not 264"
    no128 = {"build_flags": {**FA3_FWD_003_FLAGS["build_flags"], "FLASHATTENTION_DISABLE_HDIM128": True}}
    assert build_flag_reason(no128, torch.bfloat16, 112) == \
        "fa3-fwd was built without head size 128 kernels (FLASHATTENTION_DISABLE_HDIM128)"
    assert build_flag_reason(no128, torch.bfloat16, 64) is None
