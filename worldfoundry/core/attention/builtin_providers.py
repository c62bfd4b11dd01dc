"""The built-in attention providers: PyTorch's own SDPA backends.

* ``sdpa`` — :func:`torch.nn.functional.scaled_dot_product_attention` unrestricted, i.e. PyTorch's choice (what
  the dense model runs; on an H200 with bf16 that is cuDNN for long sequences);
* ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_math`` — exactly that backend
  (:func:`~worldfoundry.core.attention.sdpa_backends.scaled_dot_product_attention`), which raises
  :class:`~worldfoundry.errors.AttentionBackendError` instead of silently running another kernel.

Their probe runs a tiny attention with the backend (PyTorch decides availability per device, dtype and shape).
"""

from __future__ import annotations

import functools
from typing import Final

import torch
import torch.nn.functional as F

from worldfoundry.core.attention.providers import (
    EXACT_EQUIVALENT,
    MASK_ADDITIVE,
    MASK_BOOLEAN,
    MASK_CAUSAL,
    MASK_NONE,
    AttentionProvider,
)
from worldfoundry.core.attention.sdpa_backends import probe_sdpa_backend, scaled_dot_product_attention
from worldfoundry.errors import AttentionBackendError

#: The provider that runs PyTorch's own choice (the dense path).
DEFAULT_PROVIDER: Final = "sdpa"
_ALL_MASKS: Final = frozenset({MASK_NONE, MASK_BOOLEAN, MASK_ADDITIVE, MASK_CAUSAL})
#: provider name -> backend name of :mod:`worldfoundry.core.attention.sdpa_backends`.
SDPA_PROVIDER_BACKENDS: Final[dict[str, str]] = {
    DEFAULT_PROVIDER: "torch",
    "sdpa_flash": "flash",
    "sdpa_cudnn": "cudnn",
    "sdpa_efficient": "efficient",
    "sdpa_math": "math",
}


def _default_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


def _backend_sdpa(backend: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None) -> torch.Tensor:
    return scaled_dot_product_attention(query, key, value, backend=backend, attn_mask=attn_mask,
                                        dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def _probe(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    try:
        probe_sdpa_backend(backend, device=device, dtype=dtype, head_dim=head_dim)
    except AttentionBackendError as exc:
        return f"PyTorch SDPA backend {backend!r} is not available for {dtype} on {device} with head size " \
               f"{head_dim}: {exc.reason}"
    except RuntimeError as exc:  # e.g. CUDA not compiled in
        return f"PyTorch SDPA backend {backend!r} cannot run on {device}: {exc}"
    return None


def builtin_providers() -> tuple[AttentionProvider, ...]:
    """Fresh :class:`AttentionProvider` objects for the PyTorch SDPA backends (``sdpa`` first)."""
    version = torch.__version__.split("+")[0]
    providers = [AttentionProvider(
        name=DEFAULT_PROVIDER, version=version, numerics=EXACT_EQUIVALENT, attention=_default_sdpa,
        masks=_ALL_MASKS, device_types=("cpu", "cuda"), supports_dropout=True,
        distribution="torch", description="torch.nn.functional.scaled_dot_product_attention, PyTorch's choice")]
    for name, backend in SDPA_PROVIDER_BACKENDS.items():
        if name == DEFAULT_PROVIDER:
            continue
        providers.append(AttentionProvider(
            name=name, version=version, numerics=EXACT_EQUIVALENT,
            attention=functools.partial(_backend_sdpa, backend), masks=_ALL_MASKS, device_types=("cpu", "cuda"),
            supports_dropout=True, probe_fn=functools.partial(_probe, backend),
            distribution="torch", description=f"PyTorch SDPA restricted to the {backend} backend (fails loudly)"))
    return tuple(providers)


__all__ = ["DEFAULT_PROVIDER", "SDPA_PROVIDER_BACKENDS", "builtin_providers"]
