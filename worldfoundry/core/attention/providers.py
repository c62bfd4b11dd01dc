"""The attention provider contract: a named attention kernel with declared capabilities and a probe.

A provider computes softmax attention with the signature and layout of
:func:`torch.nn.functional.scaled_dot_product_attention`::

    attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None) -> Tensor

on ``(batch, heads, tokens, head_dim)`` tensors, returning ``(batch, heads, query_tokens, value_head_dim)``.
Kernels written for ``(batch, tokens, heads, head_dim)`` wrap themselves with :func:`from_tokens_major`.

Besides the callable a provider declares what it supports (dtypes, head sizes, masks, device types, minimum
compute capability, dropout) and its numerics class:

* :data:`EXACT_EQUIVALENT` — the same accuracy class as PyTorch SDPA (error to an fp32 reference no worse),
  only the rounding differs; not bitwise equal to SDPA;
* :data:`APPROXIMATE` — lower precision by design (quantised Q/K, FP8 P·V, sparsity); judged on quality.

:meth:`AttentionProvider.probe` answers at install time whether the provider can run at all on a device and
dtype (``None`` when it can, else the reason); :meth:`AttentionProvider.check_call` answers per call, cheaply,
whether it can run these tensors (the caller then falls back visibly).

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> p = AttentionProvider(name="plain", version="1", numerics=EXACT_EQUIVALENT,
    ...                       attention=F.scaled_dot_product_attention, dtypes=(torch.float32,),
    ...                       device_types=("cpu",))
    >>> p.probe("cpu", torch.float16, 64)
    "plain supports dtypes ['float32'], not float16"
    >>> p.probe("cpu", torch.float32, 64) is None
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import torch

#: Numerics classes.
EXACT_EQUIVALENT: Final = "exact_equivalent"
APPROXIMATE: Final = "approximate"
NUMERICS: Final = (EXACT_EQUIVALENT, APPROXIMATE)

#: Mask kinds a provider may support.
MASK_NONE: Final = "none"
MASK_BOOLEAN: Final = "boolean"
MASK_ADDITIVE: Final = "additive"
MASK_CAUSAL: Final = "causal"
MASKS: Final = (MASK_NONE, MASK_BOOLEAN, MASK_ADDITIVE, MASK_CAUSAL)

AttentionFn = Callable[..., torch.Tensor]
ProbeFn = Callable[[torch.device, torch.dtype, int], "str | None"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class AttentionProvider:
    """One attention kernel.

    Attributes:
        name: registry name (identifier-like, e.g. ``"fa3"``).
        version: version of the kernel package (``"0.0.3"``), for receipts.
        numerics: :data:`EXACT_EQUIVALENT` or :data:`APPROXIMATE`.
        attention: the SDPA-signature callable on ``(B, H, S, D)`` tensors.
        dtypes: supported query/key/value dtypes; ``None`` = any floating dtype.
        head_dims: supported head sizes; ``None`` = any.
        masks: supported mask kinds (:data:`MASKS`).
        device_types: supported ``torch.device`` types (``"cuda"``, ``"cpu"``).
        min_compute_capability: lowest CUDA compute capability ``(major, minor)``; ``None`` = no limit.
        supports_dropout: whether ``dropout_p > 0`` is honoured.
        supports_gqa: whether the callable handles key/value with fewer heads than the query by their shapes
            (the contract passes no ``enable_gqa`` flag; calls with ``enable_gqa=True`` are declined otherwise).
        probe_fn: extra environment check ``(device, dtype, head_dim) -> reason | None`` (package import,
            torch version, architecture of the compiled kernels).
        description: one line for listings.
        distribution: the distribution that registered it (set by the registry).
    """

    name: str
    version: str
    numerics: str
    attention: AttentionFn
    dtypes: tuple[torch.dtype, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    masks: frozenset[str] = frozenset({MASK_NONE})
    device_types: tuple[str, ...] = ("cuda",)
    min_compute_capability: tuple[int, int] | None = None
    supports_dropout: bool = False
    supports_gqa: bool = False
    probe_fn: ProbeFn | None = None
    description: str = ""
    distribution: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.replace("_", "").replace("-", "").isalnum():
            raise TypeError(f"attention provider name must be an identifier-like string, got {self.name!r}")
        if self.numerics not in NUMERICS:
            raise ValueError(f"provider {self.name!r}: numerics must be one of {list(NUMERICS)}, got {self.numerics!r}")
        if not callable(self.attention):
            raise TypeError(f"provider {self.name!r}: attention must be callable")
        masks = frozenset(self.masks)
        unknown = sorted(masks - set(MASKS))
        if unknown:
            raise ValueError(f"provider {self.name!r}: unknown mask kinds {unknown}; known: {list(MASKS)}")
        object.__setattr__(self, "masks", masks | {MASK_NONE})
        object.__setattr__(self, "device_types", tuple(self.device_types))
        if self.dtypes is not None:
            object.__setattr__(self, "dtypes", tuple(self.dtypes))
        if self.head_dims is not None:
            object.__setattr__(self, "head_dims", tuple(sorted(set(int(d) for d in self.head_dims))))

    @property
    def approximate(self) -> bool:
        return self.numerics == APPROXIMATE

    # ------------------------------------------------------------------ probing
    def probe(self, device: torch.device | str, dtype: torch.dtype, head_dim: int, *,
              masks: Iterable[str] = (MASK_NONE,)) -> str | None:
        """Why this provider cannot run on ``device`` / ``dtype`` / ``head_dim`` (``None`` when it can).

        Args:
            device: where attention runs.
            dtype: the query/key/value dtype.
            head_dim: the head size.
            masks: mask kinds the caller will pass.

        Returns:
            ``None``, or a one-line reason naming the provider.
        """
        device = torch.device(device)
        if device.type not in self.device_types:
            return f"{self.name} runs on {list(self.device_types)}, not {device.type}"
        if self.min_compute_capability is not None and device.type == "cuda":
            if not torch.cuda.is_available():
                return f"{self.name} needs CUDA, which is not available"
            cc = torch.cuda.get_device_capability(device)
            if tuple(cc) < tuple(self.min_compute_capability):
                want = ".".join(map(str, self.min_compute_capability))
                return f"{self.name} needs compute capability >= {want}, this GPU has {cc[0]}.{cc[1]}"
        reason = self._dtype_reason(dtype) or self._head_dim_reason(head_dim)
        if reason is not None:
            return reason
        missing = sorted(set(masks) - self.masks)
        if missing:
            return f"{self.name} supports masks {sorted(self.masks)}, not {missing}"
        if self.probe_fn is not None:
            return self.probe_fn(device, dtype, int(head_dim))
        return None

    def check_call(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   enable_gqa: bool = False) -> str | None:
        """Cheap per-call check of the inputs against the declared capabilities (``None`` = can run)."""
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            return "inputs are not 4-D (batch, heads, tokens, head_dim)"
        if query.device.type not in self.device_types:
            return f"device {query.device.type} not supported"
        if not (query.dtype == key.dtype == value.dtype):
            return "query, key and value dtypes differ"
        reason = self._dtype_reason(query.dtype) or self._head_dim_reason(query.shape[-1])
        if reason is not None:
            return reason
        if value.shape[-1] != query.shape[-1]:
            return "value head size differs from the query's"
        if attn_mask is not None:
            kind = MASK_BOOLEAN if attn_mask.dtype == torch.bool else MASK_ADDITIVE
            if kind not in self.masks:
                return f"{kind} attn_mask not supported"
        if is_causal:
            if MASK_CAUSAL not in self.masks:
                return "is_causal not supported"
            if query.shape[-2] != key.shape[-2]:
                return "is_causal with different query and key lengths"
        if dropout_p and not self.supports_dropout:
            return "dropout not supported"
        if (enable_gqa or key.shape[1] != query.shape[1]) and not self.supports_gqa:
            return "grouped-query attention not supported"
        return None

    def _dtype_reason(self, dtype: torch.dtype) -> str | None:
        if self.dtypes is not None and dtype not in self.dtypes:
            names = [_dtype_name(d) for d in self.dtypes]
            return f"{self.name} supports dtypes {names}, not {_dtype_name(dtype)}"
        if self.dtypes is None and not dtype.is_floating_point:
            return f"{self.name} needs a floating dtype, not {_dtype_name(dtype)}"
        return None

    def _head_dim_reason(self, head_dim: int) -> str | None:
        if self.head_dims is not None and int(head_dim) not in self.head_dims:
            shown = list(self.head_dims) if len(self.head_dims) <= 8 else f"{self.head_dims[0]}..{self.head_dims[-1]}"
            return f"{self.name} supports head sizes {shown}, not {int(head_dim)}"
        return None

    # ------------------------------------------------------------------ reporting
    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "numerics": self.numerics,
            "dtypes": None if self.dtypes is None else [_dtype_name(d) for d in self.dtypes],
            "head_dims": None if self.head_dims is None else list(self.head_dims),
            "masks": sorted(self.masks),
            "device_types": list(self.device_types),
            "min_compute_capability": None if self.min_compute_capability is None
            else ".".join(map(str, self.min_compute_capability)),
            "supports_dropout": self.supports_dropout,
            "distribution": self.distribution,
            "description": self.description,
        }


def from_tokens_major(kernel: Callable[..., torch.Tensor]) -> AttentionFn:
    """Adapt a ``(batch, tokens, heads, head_dim)`` kernel to the provider contract's ``(B, H, S, D)`` layout.

    ``kernel(q, k, v, *, scale, is_causal)`` receives the transposed views (no copy when the caller's tensors
    came from a tokens-major layout, as diffusers' dispatcher passes them) and returns ``(B, S, H, D)``; the
    result is handed back transposed to ``(B, H, S, D)``.

    Args:
        kernel: the tokens-major attention.

    Returns:
        An SDPA-signature callable. It raises ``ValueError`` for ``attn_mask`` or ``dropout_p`` (check them
        with :meth:`AttentionProvider.check_call` first).
    """

    @functools.wraps(kernel)
    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
        if attn_mask is not None or dropout_p:
            raise ValueError(f"{getattr(kernel, '__name__', 'kernel')} takes no attn_mask or dropout")
        out = kernel(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scale,
                     is_causal=is_causal)
        return out.transpose(1, 2)

    return attention


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                        scale: float | None = None) -> torch.Tensor:
    """Softmax attention in float32 (the reference providers are measured against), returned in float32.

    Raises:
        ValueError: ``dropout_p`` is not 0.
    """
    if dropout_p:
        raise ValueError("reference_attention takes no dropout")
    q, k, v = (t.float() for t in (query, key, value))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask.float()
    return torch.softmax(scores, dim=-1) @ v


def relative_l2(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """``||candidate - reference|| / ||reference||`` in float64."""
    diff = (candidate.double() - reference.double()).norm()
    return float(diff / reference.double().norm().clamp_min(1e-300))


__all__ = [
    "APPROXIMATE",
    "EXACT_EQUIVALENT",
    "MASKS",
    "MASK_ADDITIVE",
    "MASK_BOOLEAN",
    "MASK_CAUSAL",
    "MASK_NONE",
    "NUMERICS",
    "AttentionFn",
    "AttentionProvider",
    "from_tokens_major",
    "reference_attention",
    "relative_l2",
]
