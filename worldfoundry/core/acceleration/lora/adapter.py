"""Runtime objects of an FP32 LoRA adapter on Linear projections: shared down projections and per-projection steps.

Projections that read the same input (Q/K/V of one self-attention, K/V of one cross-attention) share one down
step: their ``A`` matrices are stacked by rows (an ``A`` shared by several projections, as in the MiniMax-H3
fused QKV adapter, is stacked once) and ``t = x @ A_stackedᵀ`` is computed once per input tensor. The cached
``t`` is keyed by the identity and version counter of the input tensor (held through a weak reference, so no
activation is kept alive) and dropped once every member has used it. Tensors created under
``torch.inference_mode`` have no version counter; for them the identity alone is the key.

Adapter tensors live on the compute device given at construction; a call on another device copies them
there once (counted in :attr:`SharedDownProjection.device_copies`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worldfoundry.core.acceleration.lora.dispatch import (
    LoraKernelStats,
    lora_down,
    lora_up_add,
)
from worldfoundry.core.acceleration.lora.reference import (
    DEFAULT_CHUNK_BYTES,
    split_bf16x3,
)
from worldfoundry.core.acceleration.lora.triton_kernels import KERNEL_MAX_RANK


def canonical_device(device: torch.device | str) -> torch.device:
    """``cuda`` → ``cuda:<current>`` so devices compare equal to ``tensor.device``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _version_of(x: torch.Tensor) -> int:
    """The version counter, or ``-1`` for inference-mode tensors (they have none; identity alone keys them)."""
    return -1 if x.is_inference() else int(x._version)


@dataclass
class _CachedDown:
    source: weakref.ReferenceType[torch.Tensor]
    version: int
    t: torch.Tensor
    remaining: int


class SharedDownProjection:
    """Stacked ``A`` rows of the adapters that read one input, with a one-entry cache of ``x @ Aᵀ``.

    Args:
        a: ``(rank_total, in_features)`` FP32 (CPU or device); copied to ``device``.
        consumers: how many projections read the cached result before it is dropped.
        device: the compute device.
    """

    def __init__(self, a: torch.Tensor, consumers: int, device: torch.device | str) -> None:
        if a.dim() != 2 or a.dtype != torch.float32:
            raise ValueError(f"A must be a 2-D float32 tensor, got {tuple(a.shape)} {a.dtype}")
        self.rank_total = int(a.shape[0])
        self.in_features = int(a.shape[1])
        self.consumers = max(1, int(consumers))
        self._host = a.detach().to("cpu", copy=True).contiguous()
        self._weights: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._cache: _CachedDown | None = None
        self._lock = threading.Lock()
        self.device_copies = 0
        self.device = canonical_device(device)
        self.weights_on(self.device)
        self.device_copies = 0  # the copy made at construction is the planned one

    def weights_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, split_bf16x3(A))`` on ``device`` (copied once per device)."""
        device = canonical_device(device)
        found = self._weights.get(device)
        if found is None:
            a = self._host.to(device)
            found = (a, split_bf16x3(self._host).to(device))
            self._weights[device] = found
            self.device_copies += 1
        return found

    def down(self, x: torch.Tensor, stats: LoraKernelStats | None = None, *,
             chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
        """``x @ Aᵀ`` as ``(rows, rank_total)`` FP32, computed once per input tensor for all consumers."""
        version = _version_of(x)
        with self._lock:
            cached = self._cache
            if (cached is not None and cached.source() is x and cached.version == version
                    and cached.t.device == x.device):
                cached.remaining -= 1
                if cached.remaining <= 0:
                    self._cache = None
                return cached.t
        a, a3 = self.weights_on(x.device)
        t = lora_down(x, a, a3, stats, chunk_bytes=chunk_bytes)
        with self._lock:
            self._cache = (
                _CachedDown(weakref.ref(x), version, t, self.consumers - 1) if self.consumers > 1 else None
            )
        return t

    def clear_cache(self) -> None:
        with self._lock:
            self._cache = None

    def release(self) -> None:
        """Drop every device copy and the cache."""
        with self._lock:
            self._cache = None
        self._weights.clear()


class LoraProjection:
    """One adapted projection: ``y = round(float(base) + scale * (x @ Aᵀ) @ Bᵀ)``.

    Args:
        down: the shared down step holding this adapter's ``A`` rows.
        offset: first row of this adapter's ``A`` inside ``down``.
        b: ``(out_features, rank)`` FP32.
        scale: effective scale (alpha/rank folded in).
        device: the compute device.
    """

    def __init__(self, down: SharedDownProjection, offset: int, b: torch.Tensor, scale: float,
                 device: torch.device | str) -> None:
        if b.dim() != 2 or b.dtype != torch.float32:
            raise ValueError(f"B must be a 2-D float32 tensor, got {tuple(b.shape)} {b.dtype}")
        if offset < 0 or offset + b.shape[1] > down.rank_total:
            raise ValueError(f"offset {offset} + rank {b.shape[1]} exceeds the stacked rank {down.rank_total}")
        self.down = down
        self.offset = int(offset)
        self.rank = int(b.shape[1])
        self.scale = float(scale)
        self._host_b = b.detach().to("cpu", copy=True).contiguous()
        self._b: dict[torch.device, torch.Tensor] = {}
        self.b_on(canonical_device(device))

    def b_on(self, device: torch.device) -> torch.Tensor:
        device = canonical_device(device)
        found = self._b.get(device)
        if found is None:
            found = self._host_b.to(device)
            self._b[device] = found
        return found

    def apply(self, x: torch.Tensor, base_out: torch.Tensor, stats: LoraKernelStats | None = None, *,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
        """The adapted output for input ``x`` whose base output is ``base_out`` (a new tensor).

        Raises:
            ValueError: ``x`` or ``base_out`` do not match the adapter's features or each other's rows.
        """
        if x.shape[-1] != self.down.in_features or base_out.shape[-1] != self._host_b.shape[0]:
            raise ValueError(
                f"adapter expects input features {self.down.in_features} and output features "
                f"{self._host_b.shape[0]}, got {tuple(x.shape)} -> {tuple(base_out.shape)}"
            )
        if x.shape[:-1].numel() != base_out.shape[:-1].numel():
            raise ValueError(f"input rows {tuple(x.shape[:-1])} and output rows {tuple(base_out.shape[:-1])} differ")
        t = self.down.down(x, stats, chunk_bytes=chunk_bytes)
        return lora_up_add(base_out, t, self.b_on(base_out.device), self.scale, stats, offset=self.offset,
                           chunk_bytes=chunk_bytes)

    def release(self) -> None:
        self._b.clear()


def stack_down_groups(members: Sequence[tuple[str, torch.Tensor]],
                      max_rank: int = KERNEL_MAX_RANK) -> list[tuple[torch.Tensor, dict[str, int]]]:
    """Stack the ``A`` matrices of projections that read one input.

    ``A`` tensors that are the same object are stacked once. When the stacked rank would exceed ``max_rank``,
    the members are split into several groups (each still reads the input once per group).

    Args:
        members: ``(name, A)`` pairs in a stable order; every ``A`` has the same ``in_features``.
        max_rank: the largest stacked rank of one group.

    Returns:
        ``[(A_stacked, {name: row offset}), ...]``.

    Raises:
        ValueError: the members disagree on ``in_features``.
    """
    groups: list[tuple[list[torch.Tensor], dict[int, int], dict[str, int]]] = []
    features = {int(a.shape[1]) for _, a in members}
    if len(features) > 1:
        raise ValueError(f"members of one down group disagree on in_features: {sorted(features)}")
    for name, a in members:
        owner = next((g for g in groups if id(a) in g[1]), None)
        if owner is None:
            owner = next((g for g in groups if sum(int(p.shape[0]) for p in g[0]) + int(a.shape[0]) <= max_rank), None)
            if owner is None:
                owner = ([], {}, {})
                groups.append(owner)
            owner[1][id(a)] = sum(int(p.shape[0]) for p in owner[0])
            owner[0].append(a)
        owner[2][name] = owner[1][id(a)]
    return [(torch.cat([p.detach().float() for p in parts], dim=0).contiguous(), offsets)
            for parts, _, offsets in groups]
