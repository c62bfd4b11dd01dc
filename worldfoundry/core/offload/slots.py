"""The two-slot, event-synchronised prefetch manager.

Blocks that are not resident run out of device *slots* (two by default). Each slot has a ``ready`` event
(its copy finished, recorded on the copy stream) and a ``free`` event (the compute that read it finished,
recorded on the compute stream):

* a copy into a slot first makes the copy stream wait on the slot's ``free`` event, then records ``ready``;
* before a block runs, the compute stream waits on its slot's ``ready`` event (no host synchronisation);
* when the block is done, ``free`` is recorded and the next block of the plan that no slot holds yet is
  prefetched into the slot that just freed.

The plan is the order non-resident blocks ran in the previous forward (the model's block order at first),
so slots follow the real transfer order, not ``block_index % 2``. A block called out of plan is a *miss*: it
is loaded on demand into a slot that is not in use (a prefetched block evicted unused counts as
*discarded*); the result is still exact. A freshly allocated slot buffer records its ``free`` event on the
compute stream first, so the copy stream never writes memory the compute stream may still be using.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from worldfoundry.core.offload.host_storage import HostBlockStorage
from worldfoundry.core.offload.streams import OffloadBackend
from worldfoundry.errors import OffloadScheduleError

DEFAULT_NUM_SLOTS = 2
#: How many (block, slot) transfer pairs a forward keeps for receipts.
MAX_TRANSFER_LOG = 512


@dataclass
class ForwardTransfers:
    """What one forward moved through the slots."""

    transfers: int = 0
    bytes_copied: int = 0
    copy_calls: int = 0
    misses: int = 0
    discarded: int = 0
    order: list[int] = field(default_factory=list)
    transfer_log: list[tuple[int, int]] = field(default_factory=list)


class _Slot:
    __slots__ = ("index", "buffer", "ready", "free", "free_recorded", "block", "in_use", "views")

    def __init__(self, index: int, backend: OffloadBackend) -> None:
        self.index = index
        self.buffer: torch.Tensor | None = None
        self.ready: Any = backend.new_event(f"slot{index}.ready")
        self.free: Any = backend.new_event(f"slot{index}.free")
        self.free_recorded = False
        self.block: int | None = None  # block copied into this slot and not yet consumed
        self.in_use = False
        self.views: dict[int, list[torch.Tensor]] = {}


class SlotManager:
    """Moves non-resident blocks through ``num_slots`` device buffers on the backend's copy stream.

    Args:
        backend: :class:`~worldfoundry.core.offload.streams.CudaBackend` or the emulated backend.
        storages: block index -> host masters of every block that may be streamed.
        num_slots: device buffers (2: one computing, one loading).

    Buffers are allocated on first use and freed by :meth:`release` (at request end).
    """

    def __init__(self, backend: OffloadBackend, storages: Mapping[int, HostBlockStorage], *,
                 num_slots: int = DEFAULT_NUM_SLOTS) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.backend = backend
        self.storages = dict(storages)
        self.slot_nbytes = max((s.layout.nbytes for s in self.storages.values()), default=0)
        self._slots = [_Slot(i, backend) for i in range(num_slots)]
        self._plan: list[int] = []
        self._pos = 0
        self._stats = ForwardTransfers()
        self._compute: Any = None

    # ------------------------------------------------------------------ state
    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def allocated_bytes(self) -> int:
        """Device bytes the slot buffers hold now."""
        return sum(s.buffer.numel() for s in self._slots if s.buffer is not None)

    def holding(self) -> dict[int, int | None]:
        """Slot index -> block copied into it and not yet consumed (for tests and diagnostics)."""
        return {s.index: s.block for s in self._slots}

    # ------------------------------------------------------------------ forward
    def begin_forward(self, plan: Sequence[int], compute_stream: Any) -> None:
        """Start a forward: remember the predicted order and prefetch its first blocks into free slots."""
        self._plan = [b for b in plan if b in self.storages]
        self._pos = 0
        self._stats = ForwardTransfers()
        self._compute = compute_stream
        for slot in self._slots:
            if slot.block is None and not slot.in_use:
                nxt = self._next_unheld()
                if nxt is None:
                    break
                self._issue(slot, nxt)

    def acquire(self, block: int) -> list[torch.Tensor]:
        """Make ``block`` available on the device: the compute stream waits on its slot's ``ready`` event.

        Returns:
            The block's tensors as views of the slot buffer, in layout order.

        Raises:
            OffloadScheduleError: no slot is free (more nested block calls than slots) or the block is unknown.
        """
        if block not in self.storages:
            raise OffloadScheduleError(f"block {block} is not streamed through the slots")
        slot = None
        for candidate in self._slots:
            if candidate.block == block and not candidate.in_use:
                slot = candidate
                break
        if slot is None:
            slot = self._victim()
            if slot.block is not None:
                self._stats.discarded += 1
            self._stats.misses += 1
            self._issue(slot, block)
        self.backend.timed_wait(self._compute, slot.ready)
        slot.in_use = True
        self._advance(block)
        self._stats.order.append(block)
        return slot.views[block]

    def release_block(self, block: int, *, prefetch: bool = True) -> None:
        """The compute on ``block`` is enqueued: record the slot's ``free`` event and prefetch the next block."""
        slot = None
        for candidate in self._slots:
            if candidate.in_use and candidate.block == block:
                slot = candidate
                break
        if slot is None:
            raise OffloadScheduleError(f"block {block} is not in use in any slot")
        self.backend.record(slot.free, self._compute)
        slot.free_recorded = True
        slot.in_use = False
        slot.block = None
        if prefetch:
            nxt = self._next_unheld()
            if nxt is not None:
                self._issue(slot, nxt)

    def end_forward(self) -> ForwardTransfers:
        """Drop prefetched blocks the forward did not use (counted as discarded) and return its transfers."""
        for slot in self._slots:
            if slot.in_use:
                self.backend.record(slot.free, self._compute)
                slot.free_recorded = True
                slot.in_use = False
                slot.block = None
            elif slot.block is not None:
                self._stats.discarded += 1
                slot.block = None
        stats, self._stats = self._stats, ForwardTransfers()
        self._plan = []
        self._pos = 0
        return stats

    def release(self, compute_stream: Any) -> None:
        """Free the slot buffers (request end). Later work on ``compute_stream`` is ordered after every copy."""
        if any(s.buffer is not None for s in self._slots):
            self.backend.order_after_copies(compute_stream)
        for slot in self._slots:
            slot.buffer = None
            slot.views.clear()
            slot.block = None
            slot.in_use = False
            slot.free_recorded = False

    # ------------------------------------------------------------------ internals
    def _advance(self, block: int) -> None:
        plan, pos = self._plan, self._pos
        if pos < len(plan) and plan[pos] == block:  # the usual case: the block the plan predicted
            self._pos = pos + 1
            return
        # a block outside the remaining plan leaves the plan where it is
        try:
            self._pos = plan.index(block, pos) + 1
        except ValueError:
            pass

    def _next_unheld(self) -> int | None:
        plan = self._plan
        held = [s.block for s in self._slots if s.block is not None]
        for i in range(self._pos, len(plan)):
            if plan[i] not in held:
                return plan[i]
        return None

    def _victim(self) -> _Slot:
        candidates = [s for s in self._slots if not s.in_use]
        if not candidates:
            raise OffloadScheduleError(f"all {len(self._slots)} slots are in use (nested block calls?)")
        empty = [s for s in candidates if s.block is None]
        if empty:
            return empty[0]
        remaining = self._plan[self._pos:]

        def distance(slot: _Slot) -> int:
            return remaining.index(slot.block) if slot.block in remaining else len(remaining) + 1

        return max(candidates, key=distance)

    def _allocate(self, slot: _Slot) -> None:
        slot.buffer = self.backend.empty(self.slot_nbytes)
        # The buffer comes from the compute stream's pool: order the first copy after the compute stream.
        self.backend.record(slot.free, self._compute)
        slot.free_recorded = True

    def _issue(self, slot: _Slot, block: int) -> None:
        if slot.in_use:
            raise OffloadScheduleError(f"slot {slot.index} is in use; cannot load block {block} into it")
        if slot.buffer is None:
            self._allocate(slot)
        storage = self.storages[block]
        views = slot.views.get(block)
        if views is None:
            views = storage.layout.views(slot.buffer)
            slot.views[block] = views
        emulated = self.backend.emulated
        with self.backend.copy_context():
            copy_stream = self.backend.current_stream()
            if slot.free_recorded:
                self.backend.wait(copy_stream, slot.free)
            start = time.perf_counter() if emulated else 0.0
            storage.copy_to(slot.buffer, views, non_blocking=not emulated)
            if emulated:
                slot.ready.copy_ms = (time.perf_counter() - start) * 1000.0
            self.backend.record(slot.ready, copy_stream)
        slot.block = block
        stats = self._stats
        stats.transfers += 1
        stats.bytes_copied += storage.nbytes
        stats.copy_calls += storage.copies_per_load
        if len(stats.transfer_log) < MAX_TRANSFER_LOG:
            stats.transfer_log.append((block, slot.index))
