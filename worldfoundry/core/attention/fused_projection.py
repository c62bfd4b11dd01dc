"""Fused projections: Linears that read one input computed as one GEMM on a packed weight, then split.

:func:`fused_linear` is the fast path and :func:`separate_linears` its reference (what the dense model does:
one ``F.linear`` per projection). Whether the two agree bitwise depends on the GEMM library's kernel choice for
the shapes, so :class:`SharedInputProjection` checks it on the first call of every input geometry (shape, strides,
pointer alignment, dtype, device, thread count) and runs the separate projections for geometries that differ.
A projection built on it is therefore exact by construction; the counts of fused and dense calls say how often
the fused GEMM actually ran.

Runtime protocol (one :class:`SharedInputProjection` per group, e.g. ``to_q``/``to_k``/``to_v``): the first member
("lead") calls :meth:`SharedInputProjection.compute` and :meth:`SharedInputProjection.offer`; the others call
:meth:`SharedInputProjection.take` with the same input tensor object and receive their slice. A member called
with another input (or without a lead call) gets ``None`` and runs its own projection.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worldfoundry.core.attention.fingerprints import alignment
from worldfoundry.core.attention.packed_storage import PackedWeights

#: Reason recorded when the fused GEMM differs from the separate projections for an input geometry.
NOT_BITWISE: str = "fused_gemm_not_bitwise"


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 split_sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """One ``F.linear`` on the packed weight, split along the last dimension (views, no copies).

    Args:
        x: ``(..., in_features)``.
        weight: packed ``(sum(split_sizes), in_features)``.
        bias: packed ``(sum(split_sizes),)`` or ``None``.
        split_sizes: the members' ``out_features``.

    Returns:
        One view per member, ``(..., out_features_i)``.
    """
    return tuple(F.linear(x, weight, bias).split(list(split_sizes), dim=-1))


def separate_linears(x: torch.Tensor, weights: Sequence[torch.Tensor],
                     biases: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """The reference: one ``F.linear`` per member, as the dense model computes them."""
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))


def outputs_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Bitwise equality of two output tuples (same shapes, dtypes and values; NaNs compare by bit pattern)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.dtype.is_floating_point and x.element_size() in (2, 4, 8):
            view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
            if not torch.equal(x.contiguous().view(view), y.contiguous().view(view)):
                return False
        elif not torch.equal(x, y):
            return False
    return True


@dataclass(frozen=True)
class ProjectionResult:
    """The outputs of one group call.

    Attributes:
        outputs: one tensor per member.
        fused: ``True`` when they come from the fused GEMM.
        reason: why the separate projections ran (``None`` when fused).
        verified: ``True`` when this call checked the geometry (first call of that geometry).
        cached: ``True`` when the outputs were reused from a cache instead of being computed now.
    """

    outputs: tuple[torch.Tensor, ...]
    fused: bool
    reason: str | None = None
    verified: bool = False
    cached: bool = False


class _Pending:
    __slots__ = ("x", "result", "remaining")

    def __init__(self, x: torch.Tensor, result: ProjectionResult, members: int) -> None:
        self.x = x
        self.result = result
        self.remaining = set(range(1, members))


class SharedInputProjection:
    """Runs a group of Linears that read the same input as one fused GEMM, exact by verification.

    Args:
        split_sizes: the members' ``out_features`` in packing order.
        packed: returns the current :class:`PackedWeights`, or a reason string when the fused path cannot run
            (the separate projections then run and the reason is reported).
    """

    def __init__(self, split_sizes: Sequence[int], packed: Callable[[], PackedWeights | str]) -> None:
        self.split_sizes = tuple(split_sizes)
        self._packed = packed
        self._verdicts: dict[tuple[Any, ...], bool] = {}
        self._local = threading.local()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ computing
    def geometry(self, x: torch.Tensor, packed: PackedWeights) -> tuple[Any, ...]:
        """The key under which bitwise agreement is checked once."""
        threads = torch.get_num_threads() if x.device.type == "cpu" else 0
        return (x.device, x.dtype, tuple(x.shape), tuple(x.stride()), alignment(x), packed.layout,
                tuple(packed.weight.shape), packed.bias is not None, threads)

    def verdicts(self) -> dict[str, bool]:
        """Checked geometries (as strings) and whether the fused GEMM was bitwise equal there."""
        with self._lock:
            return {_geometry_text(k): v for k, v in self._verdicts.items()}

    def compute(self, x: torch.Tensor, originals: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> ProjectionResult:
        """Project ``x`` with every member: fused when it is known (or now shown) to be bitwise equal.

        Args:
            x: the shared input.
            originals: the members' original forwards, in packing order (the reference and the fallback).

        Returns:
            A :class:`ProjectionResult` with one output per member.
        """
        packed = self._packed()
        if isinstance(packed, str):
            return ProjectionResult(tuple(orig(x) for orig in originals), False, packed)
        key = self.geometry(x, packed)
        verdict = self._verdicts.get(key)  # a single dict read is atomic; writes take the lock
        if verdict is False:
            return ProjectionResult(tuple(orig(x) for orig in originals), False, NOT_BITWISE)
        fused = fused_linear(x, packed.weight, packed.bias, self.split_sizes)
        if verdict is True:
            return ProjectionResult(fused, True)
        dense = tuple(orig(x) for orig in originals)
        verdict = outputs_equal(fused, dense)
        with self._lock:
            self._verdicts[key] = verdict
        if verdict:
            return ProjectionResult(fused, True, verified=True)
        return ProjectionResult(dense, False, NOT_BITWISE, verified=True)

    # ------------------------------------------------------------------ handing slices to the other members
    def offer(self, x: torch.Tensor, result: ProjectionResult) -> None:
        """Keep ``result`` for the other members' calls with the same ``x`` (this thread only)."""
        if len(self.split_sizes) > 1:
            self._local.pending = _Pending(x, result, len(self.split_sizes))

    def take(self, index: int, x: torch.Tensor) -> ProjectionResult | None:
        """Member ``index``'s part of the pending result for ``x``, or ``None`` (run the member itself).

        Returns:
            A :class:`ProjectionResult` whose ``outputs`` holds only this member's tensor.
        """
        pending: _Pending | None = getattr(self._local, "pending", None)
        if pending is None or pending.x is not x or index not in pending.remaining:
            return None
        pending.remaining.discard(index)
        if not pending.remaining:
            self._local.pending = None
        result = pending.result
        return ProjectionResult((result.outputs[index],), result.fused, result.reason, result.verified, result.cached)

    def follower_forward(
        self,
        index: int,
        original: Callable[[torch.Tensor], torch.Tensor],
        on_result: Callable[[int, ProjectionResult | None], None],
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A forward for member ``index`` (> 0): its pending slice, else its own ``original`` projection.

        ``on_result(index, result)`` is told what happened (``None``: no pending slice, the original ran).
        """

        def forward(input: torch.Tensor) -> torch.Tensor:
            taken = self.take(index, input)
            on_result(index, taken)
            if taken is None:
                return original(input)
            return taken.outputs[0]

        return forward

    def clear(self) -> None:
        """Forget pending slices of this thread and every verdict."""
        self._local.pending = None
        with self._lock:
            self._verdicts.clear()


def _geometry_text(key: tuple[Any, ...]) -> str:
    device, dtype, shape, stride, align, _layout, weight_shape, has_bias, threads = key
    text = f"{device} {str(dtype).removeprefix('torch.')} x{list(shape)} w{list(weight_shape)}"
    if not has_bias:
        text += " no-bias"
    if threads:
        text += f" threads={threads}"
    return text + f" align={align}"


__all__ = [
    "NOT_BITWISE",
    "ProjectionResult",
    "SharedInputProjection",
    "fused_linear",
    "outputs_equal",
    "separate_linears",
]
