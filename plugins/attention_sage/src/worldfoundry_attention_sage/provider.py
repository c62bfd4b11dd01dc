"""The ``sage`` attention provider: SageAttention 1.0 (``sageattention`` 1.0.6, Triton kernels), approximate.

``sageattn(q, k, v, tensor_layout="HND" | "NHD", is_causal=False, sm_scale=None, smooth_k=True)`` quantises Q and
K to INT8 per block and computes P·V in fp16; head sizes 64, 96 and 128 on CUDA. With ``smooth_k`` it subtracts
the key mean **in place** from the caller's ``k``; this provider subtracts it out of place and passes
``smooth_k=False`` (the same arithmetic: a per-query constant added to every score leaves the softmax unchanged),
so the caller's key tensor — for example a cached static K — is never modified. It runs on the tokens-major views
(``tensor_layout="NHD"``) so the output comes back in the layout diffusers reads next.

Numerics: :data:`~worldfoundry.core.attention.providers.APPROXIMATE`; measured on an H200 at B1 H12 S32760 D128
bf16: relative L2 0.0134 to an fp32 reference (SDPA's default: 0.00232). INT8/FP8 attention has been reported to
produce noise on some Hopper + Wan set-ups, so its quality is checked by the benchmark, and ``attention_policy``
claims ``role:approximate_attention`` when it routes to it.
"""

from __future__ import annotations

import importlib
import importlib.metadata as importlib_metadata
from typing import Any, Final

import torch

import worldfoundry
from worldfoundry.core.attention.providers import (
    APPROXIMATE,
    MASK_CAUSAL,
    MASK_NONE,
    AttentionProvider,
    from_tokens_major,
)

NAME: Final = "sage"
DISTRIBUTION: Final = "sageattention"
MODULE: Final = "sageattention"
SUPPORTED_MAJOR: Final = "1."
HEAD_DIMS: Final = (64, 96, 128)
INSTALL_HINT: Final = "pip install sageattention==1.0.6"


def installed_version() -> str:
    """Version of the installed ``sageattention`` distribution, or ``"not installed"``."""
    try:
        return importlib_metadata.version(DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError:
        return "not installed"


def probe(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """The package imports (with Triton) and is a 1.x release (whose ``sageattn`` signature this uses)."""
    version = installed_version()
    if version == "not installed":
        return f"sageattention is not installed; {INSTALL_HINT}"
    if not version.startswith(SUPPORTED_MAJOR):
        return f"this provider is written for sageattention 1.x, found {version}"
    try:
        importlib.import_module(MODULE)
    except Exception as exc:  # ImportError, Triton missing
        return f"cannot import {MODULE} ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


def sage_tokens_major(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float | None,
                      is_causal: bool) -> torch.Tensor:
    """SageAttention on ``(B, S, H, D)`` tensors; the inputs are never modified."""
    from sageattention import sageattn

    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    smoothed = key - key.mean(dim=1, keepdim=True)
    return sageattn(query, smoothed, value, tensor_layout="NHD", is_causal=is_causal, sm_scale=scale,
                    smooth_k=False)


def sage_provider() -> AttentionProvider:
    """The ``sage`` provider (registering it imports nothing from ``sageattention``)."""
    return AttentionProvider(
        name=NAME, version=installed_version(), numerics=APPROXIMATE, attention=from_tokens_major(sage_tokens_major),
        dtypes=(torch.bfloat16, torch.float16), head_dims=HEAD_DIMS, masks=frozenset({MASK_NONE, MASK_CAUSAL}),
        device_types=("cuda",), min_compute_capability=(8, 0), probe_fn=probe,
        distribution="worldfoundry-attention-sage",
        description="SageAttention 1.0 (INT8 Q/K per block, fp16 P.V; Triton), approximate",
    )


@worldfoundry.hookimpl
def register_attention_providers(register: Any) -> None:
    """Called once by the attention provider registry when it discovers this distribution's entry point."""
    register(sage_provider())


__all__ = ["NAME", "installed_version", "probe", "sage_provider", "sage_tokens_major"]
