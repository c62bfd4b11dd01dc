"""Explicit SDPA backends: really used, or a typed error — never a silent fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worldfoundry import testing
from worldfoundry.core.attention.sdpa_backends import (
    SDPA_BACKENDS,
    is_backend_rejection,
    probe_sdpa_backend,
    scaled_dot_product_attention,
    sdpa_backend_scope,
    torch_sdpa_backend,
    validate_sdpa_backend,
)
from worldfoundry.errors import AttentionBackendError

CUDA = torch.cuda.is_available()


OpRecorder = testing.OpRecorder


def _qkv(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, 8, 16, generator=g).to(device, dtype) for _ in range(3))


def test_names_are_validated() -> None:
    assert SDPA_BACKENDS[0] == "torch"
    for name in SDPA_BACKENDS:
        assert validate_sdpa_backend(name) == name
    assert torch_sdpa_backend("torch") is None
    with pytest.raises(ValueError, match="unknown sdpa_backend 'flash2'"):
        validate_sdpa_backend("flash2")
    with pytest.raises(ValueError):
        torch_sdpa_backend("FLASH")


def test_torch_backend_is_plain_sdpa_bitwise() -> None:
    q, k, v = _qkv()
    assert torch.equal(scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_math_backend_is_really_used_on_cpu() -> None:
    q, k, v = _qkv()
    with OpRecorder() as default:
        scaled_dot_product_attention(q, k, v, backend="torch")
    with OpRecorder() as math:
        out = scaled_dot_product_attention(q, k, v, backend="math")
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in default.ops
    assert not any("flash" in op for op in math.ops)
    assert math.ops.count("aten._safe_softmax.default") == 1
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_flash_backend_on_cpu_uses_the_cpu_flash_kernel() -> None:
    q, k, v = _qkv()
    with OpRecorder() as rec:
        scaled_dot_product_attention(q, k, v, backend="flash")
    assert rec.ops == ["aten._scaled_dot_product_flash_attention_for_cpu.default"]


@pytest.mark.filterwarnings("ignore:.*(attention|kernel)")
@pytest.mark.skipif(CUDA, reason="CPU-only rejection")
@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_backend_rejected_on_cpu_raises_typed_error(backend: str) -> None:
    q, k, v = _qkv()
    with pytest.raises(AttentionBackendError, match=backend) as info:
        scaled_dot_product_attention(q, k, v, backend=backend)
    assert info.value.backend == backend
    assert isinstance(info.value.__cause__, RuntimeError)
    assert is_backend_rejection(info.value.__cause__)
    with pytest.raises(AttentionBackendError):
        probe_sdpa_backend(backend, device="cpu", dtype=torch.float32, head_dim=16)


@pytest.mark.filterwarnings("ignore:.*[Ff]lash attention")
def test_shape_rejection_inside_a_scope_is_typed() -> None:
    # The CPU flash kernel cannot run a value head size different from the query's.
    q, k, _ = _qkv()
    v = torch.randn(1, 2, 8, 32)

    def attention() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)

    with pytest.raises(AttentionBackendError, match="'flash'"):
        with sdpa_backend_scope("flash"):
            attention()
    assert attention().shape == (1, 2, 8, 32)  # PyTorch's own choice runs it


def test_other_errors_pass_through_unchanged() -> None:
    q, k, v = _qkv()
    with pytest.raises(RuntimeError) as info:
        with sdpa_backend_scope("math"):
            F.scaled_dot_product_attention(q, k[:, :, :, :3], v)
    assert not isinstance(info.value, AttentionBackendError)
    with pytest.raises(KeyError):
        with sdpa_backend_scope("math"):
            raise KeyError("unrelated")


@pytest.mark.filterwarnings("ignore:.*[Ff]lash attention")
def test_nested_scopes_keep_the_inner_error() -> None:
    q, k, _ = _qkv()
    v = torch.randn(1, 2, 8, 32)
    with pytest.raises(AttentionBackendError) as info:
        with sdpa_backend_scope("math"), sdpa_backend_scope("flash"):
            F.scaled_dot_product_attention(q, k, v)
    assert info.value.backend == "flash"


def test_probe_accepts_available_backends() -> None:
    for backend in ("torch", "math", "flash"):
        probe_sdpa_backend(backend, device="cpu", dtype=torch.float32, head_dim=32)
    with pytest.raises(ValueError):
        probe_sdpa_backend("nope", device="cpu", dtype=torch.float32, head_dim=32)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient", "math"])
def test_cuda_backends_agree_with_math(backend: str) -> None:
    q, k, v = _qkv(dtype=torch.bfloat16, device="cuda")
    try:
        out = scaled_dot_product_attention(q, k, v, backend=backend)
    except AttentionBackendError:
        pytest.skip(f"{backend} is not available on this GPU")
    ref = scaled_dot_product_attention(q.float(), k.float(), v.float(), backend="math")
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
