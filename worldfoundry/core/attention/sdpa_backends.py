"""Scaled-dot-product attention with an explicitly chosen PyTorch backend that fails loudly.

PyTorch's :func:`torch.nn.functional.scaled_dot_product_attention` picks a kernel (flash, cuDNN, memory-efficient,
math) from the inputs. ``torch.nn.attention.sdpa_kernel([backend])`` restricts that choice to one backend; when
the backend cannot run the inputs PyTorch raises a plain ``RuntimeError`` ("No available kernel" on CUDA, "No
viable backend" on CPU). This module turns that into :class:`~worldfoundry.errors.AttentionBackendError`, so an
explicit backend is either really used or the call fails with a message that names it — never a silent fallback.

Backend names (what an attention acceleration's ``sdpa_backend`` option selects):

* ``"torch"`` — no restriction, PyTorch's own choice (what the dense model does);
* ``"flash"``, ``"cudnn"``, ``"efficient"``, ``"math"`` — exactly that backend.

Example:
    >>> import torch
    >>> q = torch.randn(1, 2, 8, 16)
    >>> out = scaled_dot_product_attention(q, q, q, backend="math")
    >>> tuple(out.shape)
    (1, 2, 8, 16)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from worldfoundry.errors import AttentionBackendError

#: Accepted ``sdpa_backend`` names, ``"torch"`` first (the default: no restriction).
SDPA_BACKENDS: Final[tuple[str, ...]] = ("torch", "flash", "cudnn", "efficient", "math")

_TORCH_BACKENDS: Final[dict[str, SDPBackend]] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}

#: Substrings of the ``RuntimeError`` PyTorch raises when no enabled backend can run the inputs
#: (CUDA: ``sdp_utils.cpp``; CPU: ``sdp_utils_cpp.cpp``).
_REJECTION_MARKERS: Final[tuple[str, ...]] = (
    "No available kernel",
    "No viable backend for scaled_dot_product_attention",
)


def validate_sdpa_backend(name: object) -> str:
    """Return ``name`` if it is one of :data:`SDPA_BACKENDS`.

    Args:
        name: the candidate backend name.

    Returns:
        The same name.

    Raises:
        ValueError: ``name`` is not a known backend name (the message lists them).
    """
    if not isinstance(name, str) or name not in SDPA_BACKENDS:
        raise ValueError(f"unknown sdpa_backend {name!r}; choose one of {list(SDPA_BACKENDS)}")
    return name


def torch_sdpa_backend(name: str) -> SDPBackend | None:
    """The :class:`torch.nn.attention.SDPBackend` of a backend name (``None`` for ``"torch"``).

    Raises:
        ValueError: unknown name.
    """
    validate_sdpa_backend(name)
    return _TORCH_BACKENDS.get(name)


def is_backend_rejection(exc: BaseException) -> bool:
    """Whether ``exc`` is PyTorch's "no enabled SDPA backend can run these inputs" error."""
    if isinstance(exc, AttentionBackendError):
        return False
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _REJECTION_MARKERS)


@contextlib.contextmanager
def sdpa_backend_scope(backend: str) -> Iterator[None]:
    """Restrict every SDPA call inside the block to ``backend`` and fail loudly when it cannot run.

    ``"torch"`` adds no restriction. The restriction is thread-local state of PyTorch, like ``sdpa_kernel``.

    Args:
        backend: one of :data:`SDPA_BACKENDS`.

    Raises:
        ValueError: unknown backend name.
        AttentionBackendError: an SDPA call inside the block was rejected by PyTorch for this backend
            (the original ``RuntimeError`` is chained). Other exceptions pass through unchanged.
    """
    torch_backend = torch_sdpa_backend(backend)
    if torch_backend is None:
        yield
        return
    with sdpa_kernel([torch_backend]):
        try:
            yield
        except RuntimeError as exc:
            if is_backend_rejection(exc):
                raise AttentionBackendError(backend, _first_line(exc)) from exc
            raise


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    backend: str = "torch",
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """:func:`torch.nn.functional.scaled_dot_product_attention` on ``(batch, heads, tokens, head_dim)`` inputs,
    run with exactly ``backend``.

    Args:
        query, key, value: attention inputs in PyTorch's SDPA layout.
        backend: one of :data:`SDPA_BACKENDS`; ``"torch"`` lets PyTorch choose.
        attn_mask, dropout_p, is_causal, scale, enable_gqa: as in PyTorch.

    Returns:
        The attention output, shaped like ``query`` with ``value``'s head dimension.

    Raises:
        ValueError: unknown backend name.
        AttentionBackendError: PyTorch cannot run ``backend`` for these inputs.
    """
    with sdpa_backend_scope(backend):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )


def probe_sdpa_backend(backend: str, *, device: torch.device | str, dtype: torch.dtype, head_dim: int,
                       heads: int = 1, query_tokens: int = 8, key_tokens: int = 8) -> None:
    """Run a tiny attention with ``backend`` to find out early whether it exists for this device and dtype.

    Passing the probe does not guarantee every shape runs (PyTorch decides per call); calls that are rejected
    later still raise :class:`~worldfoundry.errors.AttentionBackendError`.

    Args:
        backend: one of :data:`SDPA_BACKENDS`.
        device, dtype: where and in which precision the model's attention runs.
        head_dim: the attention head size.
        heads, query_tokens, key_tokens: probe shape.

    Raises:
        ValueError: unknown backend name.
        AttentionBackendError: the backend cannot run on this device/dtype/head size.
    """
    validate_sdpa_backend(backend)
    if backend == "torch":
        return
    device = torch.device(device)
    q = torch.zeros(1, heads, query_tokens, head_dim, device=device, dtype=dtype)
    kv = torch.zeros(1, heads, key_tokens, head_dim, device=device, dtype=dtype)
    with torch.no_grad():
        scaled_dot_product_attention(q, kv, kv, backend=backend)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = [
    "SDPA_BACKENDS",
    "is_backend_rejection",
    "probe_sdpa_backend",
    "scaled_dot_product_attention",
    "sdpa_backend_scope",
    "torch_sdpa_backend",
    "validate_sdpa_backend",
]
