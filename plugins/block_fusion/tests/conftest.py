"""Tiny Wan / SANA-Video models, their inputs, and a registry of the plugins block fusion composes with.

The models run where the kernels can run: on CUDA when it is present and Triton's interpreter is off (the GPU
machine), on the CPU under ``TRITON_INTERPRET=1`` (CI). Elsewhere the kernel tests skip with the reason; the
CPU fallback without the interpreter is tested explicitly (``device="cpu"``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from worldfoundry import testing
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.dtypes import apply_dtype_policy

#: Where the builders put models and inputs by default (set by the ``kernels`` fixture).
DEVICE = torch.device("cpu")

WAN_TINY = dict(testing.WAN_TINY)
SANA_TINY = {**testing.SANA_VIDEO_TINY, "patch_size": (1, 2, 2), "rope_max_seq_len": 64}


def kernel_device() -> tuple[torch.device | None, str]:
    """Where the fusion kernels run in this process, and why not when they cannot (``(None, reason)``)."""
    from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

    if not TRITON_AVAILABLE:
        return None, "triton is not importable"
    if interpreter_enabled():
        return torch.device("cpu"), "Triton's interpreter runs the kernels on CPU tensors"
    if torch.cuda.is_available():
        return torch.device("cuda"), "CUDA"
    return None, "no CUDA and TRITON_INTERPRET is not set (set TRITON_INTERPRET=1 to test on the CPU)"


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device(device) if device is not None else DEVICE


def _on(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def build_wan(dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: torch.device | str | None = None,
              **overrides: Any) -> nn.Module:
    model = testing.tiny_wan(seed, weight_scale=None, **overrides)
    model = apply_dtype_policy(model, dtype).eval() if dtype != torch.float32 else model
    return model.to(_device(device))


def wan_inputs(dtype: torch.dtype = torch.bfloat16, seed: int = 1, *, text_tokens: int = 24, frames: int = 2,
               image_tokens: int = 0, timestep: torch.Tensor | None = None,
               device: torch.device | str | None = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    inputs: dict[str, Any] = {
        "hidden_states": torch.randn(1, 16, frames, 8, 8, generator=g).to(dtype),
        "timestep": timestep if timestep is not None else torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, text_tokens, 32, generator=g).to(dtype),
        "return_dict": False,
    }
    if image_tokens:
        inputs["encoder_hidden_states_image"] = torch.randn(1, image_tokens, 32, generator=g).to(dtype)
    return _on(inputs, _device(device))


def build_sana(dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: torch.device | str | None = None
               ) -> nn.Module:
    model = testing.tiny_sana_video(seed, **SANA_TINY)
    model = apply_dtype_policy(model, dtype).eval() if dtype != torch.float32 else model
    return model.to(_device(device))


def sana_inputs(dtype: torch.dtype = torch.bfloat16, seed: int = 1,
                device: torch.device | str | None = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    inputs = {"hidden_states": torch.randn(1, 16, 2, 8, 8, generator=g).to(dtype), "timestep": torch.tensor([500]),
              "encoder_hidden_states": torch.randn(1, 12, 32, generator=g).to(dtype), "return_dict": False}
    return _on(inputs, _device(device))


def run(model: nn.Module, inputs: dict[str, Any], request_id: str | None = None) -> torch.Tensor:
    with torch.no_grad():
        if request_id is None:
            return model(**inputs)[0]
        with request_scope(RequestContext(request_id)):
            return model(**inputs)[0]


def make_registry() -> AccelerationRegistry:
    from worldfoundry_block_fusion import sana_plugin, wan_plugin

    reg = AccelerationRegistry(discover=False)
    reg.register("wan_block_fusion", wan_plugin.prepare)
    reg.register("sana_block_fusion", sana_plugin.prepare)
    return reg


def full_registry() -> AccelerationRegistry:
    """Block fusion and every plugin it is meant to compose (or conflict) with."""
    from worldfoundry_attention_lora.plugin import prepare_attention_lora as lora
    from worldfoundry_easycache.plugin import prepare as easycache
    from worldfoundry_optimized_mha.plugin import prepare as mha
    from worldfoundry_resident_blocks.plugin import prepare as resident
    from worldfoundry_selective_fp8.plugin import prepare as fp8
    from worldfoundry_wan_cross_kv_fusion.plugin import prepare as cross_kv

    reg = make_registry()
    for name, factory in (("attention_lora", lora), ("easycache", easycache), ("optimized_mha", mha),
                          ("resident_blocks", resident), ("selective_fp8", fp8), ("wan_cross_kv_fusion", cross_kv)):
        reg.register(name, factory)
    return reg


def record_of(session: Any, request_id: str, name: str = "wan_block_fusion") -> dict[str, Any]:
    return session.execution_report()["plugins"][name]["model"]["requests"][request_id]


def structure(model: nn.Module) -> testing.ModelFingerprint:
    """What an exact restore must give back (:func:`worldfoundry.testing.fingerprint` of the guarded model)."""
    return testing.fingerprint(testing.guarded(model), forward=False)


assert_same_structure = testing.assert_same_model


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """The device the kernels run on here (CUDA, or the CPU under Triton's interpreter); skip where neither.

    The builders of this module put models and inputs there by default while the test runs.
    """
    import sys

    device, reason = kernel_device()
    if device is None:
        pytest.skip(f"the fusion kernels cannot run here: {reason}")
    monkeypatch.setattr(sys.modules[__name__], "DEVICE", device)
    if device.type == "cpu":
        cuda_rms_norm_on_cpu(monkeypatch)
        cuda_layer_norm_on_cpu(monkeypatch)
    return device


#: PyTorch's own ``F.layer_norm`` (the ``kernels`` fixture replaces it on the CPU; see :func:`cuda_layer_norm_on_cpu`)
TORCH_LAYER_NORM = torch.nn.functional.layer_norm


def cuda_layer_norm_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager's LayerNorm computed with PyTorch's CUDA algorithm (the step-by-step reference) and the ``layer_norm``
    chain allowed on the CPU, so that the fused block and eager compute the same algorithm here; the GPU tests
    compare against PyTorch's own CUDA LayerNorm, and ``test_wan.py`` checks the real CPU fallback without this."""
    import torch.nn.functional as F  # noqa: N812

    from worldfoundry.core.fusion.layer_norm_reference import reference_layer_norm
    from worldfoundry_block_fusion import eligibility

    def cuda_algorithm(x, shape, weight=None, bias=None, eps=1e-5):  # noqa: ANN001, ANN202
        if tuple(shape) != (x.shape[-1],) or x.shape[-1] % 4 or not x.is_contiguous():
            return TORCH_LAYER_NORM(x, shape, weight, bias, eps)
        return reference_layer_norm(x, eps, weight, bias, out_dtype=x.dtype)

    monkeypatch.setattr(F, "layer_norm", cuda_algorithm)
    monkeypatch.setattr(eligibility, "NORM_DEVICES", ("cuda", "cpu"))


#: PyTorch's own ``F.rms_norm`` (the ``kernels`` fixture replaces it on the CPU; see :func:`cuda_rms_norm_on_cpu`)
TORCH_RMS_NORM = torch.nn.functional.rms_norm


def cuda_rms_norm_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager's RMSNorm computed with PyTorch's CUDA algorithm (the step-by-step reference, ``1 / sqrt`` as the
    interpreter computes ``rsqrt``) and the ``qk_norm`` chain allowed on the CPU, so that the fused self-attention
    and eager compute the same algorithm here; the GPU tests compare against PyTorch's own CUDA RMSNorm.
    ``test_qk_norm.py`` checks the real CPU fallback without this."""
    import torch.nn.functional as F  # noqa: N812

    from worldfoundry.core.fusion.layer_norm_reference import reference_rms_norm
    from worldfoundry_block_fusion import qk_norm

    original = F.rms_norm

    def cuda_algorithm(x, shape, weight=None, eps=None):  # noqa: ANN001, ANN202
        if eps is None or tuple(shape) != (x.shape[-1],) or x.shape[-1] % 4:
            return original(x, shape, weight, eps)
        return reference_rms_norm(x, eps, weight)

    monkeypatch.setattr(F, "rms_norm", cuda_algorithm)
    monkeypatch.setattr(qk_norm, "QK_NORM_DEVICES", ("cuda", "cpu"))


@pytest.fixture(autouse=True)
def blocking_kernel_compile() -> Any:
    """Kernels compile before a request's first fused call (``kernel_compile: auto`` -> ``blocking``), so counts
    hold from the first call; the tests of ``background`` ask for it explicitly."""
    from worldfoundry.core.fusion.compile_pool import set_default_compile_mode

    previous = set_default_compile_mode("blocking")
    yield
    set_default_compile_mode(previous)


@pytest.fixture
def kit() -> Any:
    """This module's builders and helpers (tests run in importlib mode and cannot import it)."""
    import sys

    return sys.modules[__name__]
