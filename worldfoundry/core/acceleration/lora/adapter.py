"""Runtime objects of an FP32 LoRA adapter on Linear projections: shared down projections and per-projection steps.

Projections that read the same input (Q/K/V of one self-attention, K/V of one cross-attention) share one down
step: their ``A`` matrices are stacked by rows, each starting on a :data:`~.reference.RANK_TILE` boundary (an
``A`` shared by several projections, as in the MiniMax-H3 fused QKV adapter, is stacked once), and
``t = x @ A_stackedᵀ`` is computed once per input tensor. Because the down kernel and the reference compute each
rank tile on its own, a member's columns of the stacked ``t`` are bitwise the ``t`` it would compute alone.

Hand-over. The attention processor calls the members one after another with the same input tensor object. The
first member called with an input computes ``t`` for the whole group (``group_computed``) and leaves it in a
one-entry cache keyed by the input's identity and version counter (held through a weak reference, so no
activation is kept alive); each other member called with the same tensor object at the same version takes its
columns (``handed_over``), and the entry is dropped once every member has taken them. A member called with a
different tensor while the entry still waits for members computes only its own tiles (``own:other_input``,
bitwise the columns the group step would have given it). A member called again after it has taken its columns,
or with the cached tensor modified in place, starts a new group step; members that never took their columns
from the dropped entry are counted (``dropped_unused``). Tensors created under ``torch.inference_mode`` have
no version counter; for them the identity alone is the key. Every event is counted in
:class:`~.dispatch.LoraKernelStats` ``shared_down``.

Adapter tensors live on the compute device given at construction; a call on another device copies them
there once (counted in :attr:`SharedDownProjection.device_copies`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import torch

from worldfoundry.core.acceleration.lora.dispatch import (
    LoraKernelStats,
    lora_down,
    lora_up_add,
)
from worldfoundry.core.acceleration.lora.reference import (
    DEFAULT_CHUNK_BYTES,
    RANK_TILE,
    padded_rank,
    split_bf16x3,
)
from worldfoundry.core.acceleration.lora.triton_kernels import KERNEL_MAX_RANK

#: Shared-down events (keys of ``LoraKernelStats.shared_down``).
GROUP_COMPUTED: Final = "group_computed"
HANDED_OVER: Final = "handed_over"
OWN_OTHER_INPUT: Final = "own:other_input"
DROPPED_UNUSED: Final = "dropped_unused"


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
    device: torch.device
    t: torch.Tensor
    waiting: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Member:
    offset: int
    rows: int  # rows of the stacked A this member's tiles cover (a multiple of RANK_TILE, clipped to the stack)


class SharedDownProjection:
    """Stacked ``A`` rows of the adapters that read one input, with a one-entry cache of ``x @ Aᵀ``.

    Members (the projections reading the input) register with :meth:`add_member`; :meth:`take` hands each of
    them its columns of ``t``.

    Args:
        a: ``(rank_total, in_features)`` FP32 (CPU or device); copied to ``device``. Members start at multiples
            of :data:`~.reference.RANK_TILE` (see :func:`stack_down_groups`).
        device: the compute device.

    Raises:
        ValueError: ``a`` is not a 2-D FP32 tensor.
    """

    def __init__(self, a: torch.Tensor, device: torch.device | str) -> None:
        if a.dim() != 2 or a.dtype != torch.float32:
            raise ValueError(f"A must be a 2-D float32 tensor, got {tuple(a.shape)} {a.dtype}")
        self.rank_total = int(a.shape[0])
        self.in_features = int(a.shape[1])
        self._host = a.detach().to("cpu", copy=True).contiguous()
        self._weights: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._members: list[_Member] = []
        self._cache: _CachedDown | None = None
        self._lock = threading.Lock()
        self.device_copies = 0
        self.device = canonical_device(device)
        self.weights_on(self.device)
        self.device_copies = 0  # the copy made at construction is the planned one

    @property
    def consumers(self) -> int:
        return len(self._members)

    def add_member(self, offset: int, rank: int) -> int:
        """Register a projection whose ``A`` occupies rows ``offset .. offset + rank - 1``; returns its id.

        Raises:
            ValueError: the rows lie outside the stack or ``offset`` is not on a tile boundary.
        """
        if offset < 0 or rank < 1 or offset + rank > self.rank_total or offset % RANK_TILE:
            raise ValueError(f"member rows {offset}..{offset + rank - 1} do not fit the stacked rank {self.rank_total} "
                             f"on a {RANK_TILE}-row tile boundary")
        rows = min(padded_rank(rank), self.rank_total - offset)
        self._members.append(_Member(int(offset), rows))
        return len(self._members) - 1

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

    def take(self, x: torch.Tensor, member: int, stats: LoraKernelStats | None = None, *,
             chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[torch.Tensor, int]:
        """``member``'s part of ``x @ Aᵀ``: ``(t, column)`` with its rank starting at ``t[:, column]`` (FP32).

        Args:
            x: the input of the member's projection ``(..., in_features)``.
            member: an id from :meth:`add_member`.
            stats: where kernel choices and shared-down events are counted.
            chunk_bytes: temporary-memory bound of the reference path.
        """
        version = _version_of(x)
        spec = self._members[member]
        event = GROUP_COMPUTED
        dropped = 0
        with self._lock:
            entry = self._cache
            if entry is not None:
                source = entry.source()
                if source is x and entry.version == version and entry.device == x.device and member in entry.waiting:
                    entry.waiting.discard(member)
                    if not entry.waiting:
                        self._cache = None
                    event = HANDED_OVER
                elif source is not None and source is not x and member in entry.waiting:
                    event = OWN_OTHER_INPUT
                else:  # freed input, modified in place, or this member already took its part: a new group step
                    dropped = len(entry.waiting)
                    self._cache = None
        if stats is not None:
            if dropped:
                stats.record_share(DROPPED_UNUSED, dropped)
            if self.consumers > 1:
                stats.record_share(event)
        if event == HANDED_OVER:
            return entry.t, spec.offset
        a, a3 = self.weights_on(x.device)
        if event == OWN_OTHER_INPUT:
            rows = slice(spec.offset, spec.offset + spec.rows)
            return lora_down(x, a[rows], a3[:, rows], stats, chunk_bytes=chunk_bytes), 0
        t = lora_down(x, a, a3, stats, chunk_bytes=chunk_bytes)
        if self.consumers > 1:
            waiting = set(range(self.consumers)) - {member}
            with self._lock:
                self._cache = _CachedDown(weakref.ref(x), version, x.device, t, waiting)
        return t, spec.offset

    def clear_cache(self) -> None:
        with self._lock:
            self._cache = None

    def release(self) -> None:
        """Drop every device copy and the cache."""
        with self._lock:
            self._cache = None
        self._weights.clear()


class LoraProjection:
    """One adapted projection: ``y = round(float(base) + (x @ Aᵀ) @ Bᵀ * scale)``.

    ``B`` is kept on the device as a contiguous ``Bᵀ`` (``(rank, out_features)``) so the up kernel's loads of it
    are coalesced; :meth:`b_on` returns the ``(out_features, rank)`` view.

    Args:
        down: the shared down step holding this adapter's ``A`` rows.
        offset: first row of this adapter's ``A`` inside ``down`` (a multiple of ``RANK_TILE``).
        b: ``(out_features, rank)`` FP32.
        scale: effective scale (alpha/rank folded in).
        device: the compute device.

    Raises:
        ValueError: ``b`` is not a 2-D FP32 tensor or its rows do not fit ``down``.
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
        self.member = down.add_member(self.offset, self.rank)
        self.scale = float(scale)
        self._host_bt = b.detach().to("cpu", copy=True).t().contiguous()
        self._bt: dict[torch.device, torch.Tensor] = {}
        self.b_on(canonical_device(device))

    @property
    def out_features(self) -> int:
        return int(self._host_bt.shape[1])

    def b_on(self, device: torch.device) -> torch.Tensor:
        """``B`` ``(out_features, rank)`` on ``device``: a view of a contiguous ``Bᵀ`` (copied once per device)."""
        device = canonical_device(device)
        found = self._bt.get(device)
        if found is None:
            found = self._host_bt.to(device)
            self._bt[device] = found
        return found.t()

    def apply(self, x: torch.Tensor, base_out: torch.Tensor, stats: LoraKernelStats | None = None, *,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
        """The adapted output for input ``x`` whose base output is ``base_out`` (a new tensor).

        Raises:
            ValueError: ``x`` or ``base_out`` do not match the adapter's features or each other's rows.
        """
        if x.shape[-1] != self.down.in_features or base_out.shape[-1] != self.out_features:
            raise ValueError(
                f"adapter expects input features {self.down.in_features} and output features "
                f"{self.out_features}, got {tuple(x.shape)} -> {tuple(base_out.shape)}"
            )
        if x.shape[:-1].numel() != base_out.shape[:-1].numel():
            raise ValueError(f"input rows {tuple(x.shape[:-1])} and output rows {tuple(base_out.shape[:-1])} differ")
        t, column = self.down.take(x, self.member, stats, chunk_bytes=chunk_bytes)
        return lora_up_add(base_out, t, self.b_on(base_out.device), self.scale, stats, offset=column,
                           chunk_bytes=chunk_bytes)

    def release(self) -> None:
        self._bt.clear()


def stack_down_groups(members: Sequence[tuple[str, torch.Tensor]],
                      max_rank: int = KERNEL_MAX_RANK) -> list[tuple[torch.Tensor, dict[str, int]]]:
    """Stack the ``A`` matrices of projections that read one input, each starting on a tile boundary.

    Every distinct ``A`` occupies ``padded_rank(rank)`` rows (its rows, then zero rows up to the next multiple
    of :data:`~.reference.RANK_TILE`); ``A`` tensors that are the same object are stacked once. When the stacked
    rows would exceed ``max_rank``, the members are split into several groups (each still reads the input once
    per group); a single ``A`` larger than ``max_rank`` gets a group of its own.

    Args:
        members: ``(name, A)`` pairs in a stable order; every ``A`` has the same ``in_features``.
        max_rank: the largest stacked rank of one group.

    Returns:
        ``[(A_stacked, {name: row offset}), ...]``.

    Raises:
        ValueError: the members disagree on ``in_features``.
    """
    features = {int(a.shape[1]) for _, a in members}
    if len(features) > 1:
        raise ValueError(f"members of one down group disagree on in_features: {sorted(features)}")
    groups: list[tuple[list[torch.Tensor], dict[int, int], dict[str, int]]] = []
    used: list[int] = []
    for name, a in members:
        index = next((i for i, g in enumerate(groups) if id(a) in g[1]), None)
        if index is None:
            rows = padded_rank(int(a.shape[0]))
            index = next((i for i, n in enumerate(used) if n + rows <= max_rank), None)
            if index is None:
                groups.append(([], {}, {}))
                used.append(0)
                index = len(groups) - 1
            parts, offsets_by_id, _ = groups[index]
            offsets_by_id[id(a)] = used[index]
            pad = rows - int(a.shape[0])
            parts.append(a.detach().float())
            if pad:
                parts.append(torch.zeros(pad, a.shape[1], dtype=torch.float32, device=a.device))
            used[index] += rows
        groups[index][2][name] = groups[index][1][id(a)]
    return [(torch.cat(parts, dim=0).contiguous(), offsets) for parts, _, offsets in groups]
