"""The ``fa3`` attention provider: FlashAttention-3's forward kernel from the ``fa3-fwd`` wheel.

``fa3-fwd`` 0.0.3 ships the FlashAttention-3 (Hopper) forward only, as the module ``fa3_fwd_interface``:
``flash_attn_func(q, k, v, softmax_scale=None, causal=False, ...)`` on ``(batch, tokens, heads, head_dim)``
tensors, returning the output in the same layout. Its build flags (``fa3_fwd_config.CONFIG``) disable fp16
kernels, so bfloat16 is the dtype it runs. The provider adapts the layout with
:func:`~worldfoundry.core.attention.providers.from_tokens_major`: diffusers' dispatcher hands SDPA transposed
views of tokens-major projections, so the kernel reads them without a copy.

Numerics: :data:`~worldfoundry.core.attention.providers.EXACT_EQUIVALENT` — fp32 accumulation and an online
softmax like cuDNN/flash SDPA; measured on an H200 at B1 H12 S32760 D128 bf16 with the same relative L2 error to
an fp32 reference as SDPA's default (0.00232). Not bitwise equal to SDPA.

The probe checks, in order: CUDA device of compute capability 9.x (the wheel's kernels are built for sm90),
torch >= 2.10, that ``fa3_fwd_interface`` imports (it loads the compiled extension), and the dtype and head size
against the wheel's build flags.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as importlib_metadata
from typing import Any, Final

import torch

import worldfoundry
from worldfoundry.core.attention.providers import (
    EXACT_EQUIVALENT,
    MASK_CAUSAL,
    MASK_NONE,
    AttentionProvider,
    from_tokens_major,
)

NAME: Final = "fa3"
DISTRIBUTION: Final = "fa3-fwd"
MODULE: Final = "fa3_fwd_interface"
CONFIG_MODULE: Final = "fa3_fwd_config"
MIN_TORCH: Final = (2, 10)
#: Head sizes FlashAttention-3 accepts: multiples of 8 up to 256 (rounded up to a compiled size).
HEAD_DIMS: Final = tuple(range(8, 257, 8))
#: compiled head size -> build flag that removes it.
_HDIM_FLAGS: Final = ((64, "FLASHATTENTION_DISABLE_HDIM64"), (96, "FLASHATTENTION_DISABLE_HDIM96"),
                      (128, "FLASHATTENTION_DISABLE_HDIM128"), (192, "FLASHATTENTION_DISABLE_HDIM192"),
                      (256, "FLASHATTENTION_DISABLE_HDIM256"))
INSTALL_HINT: Final = "pip install fa3-fwd==0.0.3 einops"


def installed_version() -> str:
    """Version of the installed ``fa3-fwd`` distribution, or ``"not installed"``."""
    try:
        return importlib_metadata.version(DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError:
        return "not installed"


def torch_version_reason(version: str | None = None) -> str | None:
    """Why this torch is too old for the wheel (``None`` when it is new enough)."""
    text = (version or torch.__version__).split("+")[0]
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < MIN_TORCH:
        return f"fa3-fwd needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {text}"
    return None


def build_flag_reason(config: dict[str, Any], dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the wheel's build flags exclude ``dtype`` / ``head_dim`` (``None`` when they are compiled in)."""
    flags = config.get("build_flags", {})
    if dtype == torch.float16 and flags.get("FLASHATTENTION_DISABLE_FP16", False):
        return "fa3-fwd was built without fp16 kernels (FLASHATTENTION_DISABLE_FP16); run the model in bfloat16"
    compiled = next((size for size, _ in _HDIM_FLAGS if head_dim <= size), None)
    if compiled is None:
        return f"FlashAttention-3 supports head sizes up to 256, not {head_dim}"
    flag = dict((size, name) for size, name in _HDIM_FLAGS)[compiled]
    if flags.get(flag, False):
        return f"fa3-fwd was built without head size {compiled} kernels ({flag})"
    return None


def probe(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Environment checks beyond the declared capabilities (see the module docstring)."""
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"fa3-fwd kernels are built for sm90 (Hopper); this GPU is sm{major}{minor}"
    reason = torch_version_reason()
    if reason is not None:
        return reason
    try:
        importlib.import_module(MODULE)
        config = importlib.import_module(CONFIG_MODULE).CONFIG
    except Exception as exc:  # ImportError, or the extension failing to load against this torch
        return f"cannot import {MODULE} ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return build_flag_reason(config, dtype, head_dim)


#: ``fa3-fwd`` versions whose compiled ``torch.ops.fa3_fwd.fwd`` takes the 34 arguments :func:`_fwd_direct` passes.
DIRECT_VERSIONS: Final = frozenset({"0.0.3"})


@functools.lru_cache(maxsize=1)
def _direct_op() -> Any:
    """The compiled forward op when this ``fa3-fwd`` version's signature is known, else ``None``."""
    if installed_version() not in DIRECT_VERSIONS:
        return None
    importlib.import_module(MODULE)  # registers torch.ops.fa3_fwd
    return torch.ops.fa3_fwd.fwd


def _direct_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False  # the direct call records no autograd graph
    return query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1


def _fwd_direct(op: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                is_causal: bool) -> torch.Tensor:
    """The arguments ``flash_attn_func`` hands the compiled op for plain attention, without its autograd
    function and ``torch.library`` custom-op layers (host time per call; same kernel, same output)."""
    if scale is None:
        scale = query.shape[-1] ** (-0.5)
    none3 = (None, None, None)
    out = op(query, key, value, None, None, None, None, *none3, None, None, None, None, *none3, *none3, *none3,
             scale, is_causal, -1, -1, 0, 0.0, True, None, 1, None, 0)
    return out[0]


def fa3_tokens_major(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float | None,
                     is_causal: bool) -> torch.Tensor:
    """FlashAttention-3 forward on ``(B, S, H, D)`` tensors.

    Without autograd and with unit-stride last dimensions (as diffusers' dispatcher passes them) the compiled op
    is called directly (:data:`DIRECT_VERSIONS`); otherwise through ``fa3_fwd_interface.flash_attn_func``.
    """
    op = _direct_op()
    if op is not None and _direct_ok(query, key, value):
        return _fwd_direct(op, query, key, value, scale, is_causal)
    from fa3_fwd_interface import flash_attn_func

    out = flash_attn_func(query, key, value, softmax_scale=scale, causal=is_causal)
    return out[0] if isinstance(out, tuple) else out


def fa3_provider() -> AttentionProvider:
    """The ``fa3`` provider (registering it imports nothing from ``fa3-fwd``)."""
    return AttentionProvider(
        name=NAME, version=installed_version(), numerics=EXACT_EQUIVALENT,
        attention=from_tokens_major(fa3_tokens_major), dtypes=(torch.bfloat16, torch.float16), head_dims=HEAD_DIMS,
        masks=frozenset({MASK_NONE, MASK_CAUSAL}), device_types=("cuda",), min_compute_capability=(9, 0),
        probe_fn=probe, distribution="worldfoundry-attention-fa3",
        description="FlashAttention-3 forward (fa3-fwd wheel), Hopper only, bf16",
    )


@worldfoundry.hookimpl
def register_attention_providers(register: Any) -> None:
    """Called once by the attention provider registry when it discovers this distribution's entry point."""
    register(fa3_provider())


__all__ = ["DIRECT_VERSIONS", "NAME", "build_flag_reason", "fa3_provider", "fa3_tokens_major", "installed_version", "probe",
           "torch_version_reason"]
