"""The two-slot manager on the emulated backend: transfer order, event discipline, misses, errors."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.offload.host_storage import HostBlockStorage
from worldfoundry.core.offload.layout import BlockLayout
from worldfoundry.core.offload.slots import SlotManager
from worldfoundry.core.offload.streams import (
    EmulatedBackend,
    EmulatedEvent,
    backend_for,
)
from worldfoundry.errors import OffloadScheduleError


class LoggingBackend(EmulatedBackend):
    """The emulated backend plus a log of every event record and wait (stream, event name)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str, str]] = []

    def record(self, event, stream) -> None:
        super().record(event, stream)
        self.log.append(("record", stream.name, event.name))

    def wait(self, stream, event) -> None:
        super().wait(stream, event)
        self.log.append(("wait", stream.name, event.name))


def _storages(n: int = 4) -> dict[int, HostBlockStorage]:
    out = {}
    for i in range(n):
        tensors = [torch.full((4, 4), float(i)), torch.full((3,), float(-i))]
        layout = BlockLayout.from_tensors([("w", tensors[0]), ("b", tensors[1])])
        out[i] = HostBlockStorage.from_tensors(layout, tensors, contiguous=bool(i % 2), pin=False)
    return out


def _run(manager: SlotManager, backend, order: list[int], plan: list[int]) -> list[list[torch.Tensor]]:
    seen = []
    manager.begin_forward(plan, backend.compute_stream)
    for block in order:
        views = manager.acquire(block)
        seen.append([v.clone() for v in views])
        manager.release_block(block)
    return seen


def test_transfer_order_and_slot_rotation() -> None:
    backend = LoggingBackend()
    manager = SlotManager(backend, _storages())
    seen = _run(manager, backend, [0, 1, 2, 3], [0, 1, 2, 3])
    for block, views in enumerate(seen):  # each block saw its own values
        assert torch.equal(views[0], torch.full((4, 4), float(block)))
        assert torch.equal(views[1], torch.full((3,), float(-block)))
    stats = manager.end_forward()
    assert stats.transfer_log == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert (stats.transfers, stats.misses, stats.discarded) == (4, 0, 0)
    assert stats.order == [0, 1, 2, 3]
    assert stats.copy_calls == 2 + 1 + 2 + 1  # per-tensor blocks 0, 2; contiguous blocks 1, 3


def test_event_discipline() -> None:
    """ready: recorded on the copy stream, then waited by compute; free: recorded by compute, then waited by
    the copy stream before the slot is overwritten."""
    backend = LoggingBackend()
    manager = SlotManager(backend, _storages())
    _run(manager, backend, [0, 1, 2, 3], [0, 1, 2, 3])
    manager.end_forward()
    for slot in (0, 1):
        ops = [(op, stream, ev.split(".")[1]) for op, stream, ev in backend.log if ev.startswith(f"slot{slot}.")]
        # allocation orders the first copy after the compute stream
        assert ops[0] == ("record", "compute", "free")
        per_block = [
            ("wait", "copy", "free"), ("record", "copy", "ready"), ("wait", "compute", "ready"),
            ("record", "compute", "free"),
        ]
        assert ops[1:] == per_block * 2


def test_unplanned_call_is_a_miss_and_exact() -> None:
    backend = EmulatedBackend()
    manager = SlotManager(backend, _storages())
    seen = _run(manager, backend, [2, 0, 1, 3], [0, 1, 2, 3])
    assert torch.equal(seen[0][0], torch.full((4, 4), 2.0))
    stats = manager.end_forward()
    assert stats.misses >= 1 and stats.discarded >= 1
    assert stats.order == [2, 0, 1, 3]


def test_never_recorded_event_is_an_error() -> None:
    backend = EmulatedBackend()
    with pytest.raises(OffloadScheduleError, match="never recorded"):
        backend.wait(backend.compute_stream, EmulatedEvent("x.ready"))


def test_nested_calls_exhaust_the_slots() -> None:
    backend = EmulatedBackend()
    manager = SlotManager(backend, _storages())
    manager.begin_forward([0, 1, 2], backend.compute_stream)
    manager.acquire(0)
    manager.acquire(1)
    with pytest.raises(OffloadScheduleError, match="all 2 slots are in use"):
        manager.acquire(2)
    with pytest.raises(OffloadScheduleError, match="not in use"):
        manager.release_block(3)
    with pytest.raises(OffloadScheduleError, match="not streamed"):
        manager.acquire(9)
    stats = manager.end_forward()
    assert stats.transfers == 2
    manager.release(backend.compute_stream)
    assert manager.allocated_bytes == 0
    assert manager.holding() == {0: None, 1: None}


def test_one_slot_serialises_copies() -> None:
    backend = EmulatedBackend()
    manager = SlotManager(backend, _storages(), num_slots=1)
    _run(manager, backend, [0, 1, 2, 3], [0, 1, 2, 3])
    assert manager.end_forward().transfer_log == [(0, 0), (1, 0), (2, 0), (3, 0)]


def test_unused_prefetch_is_discarded_at_forward_end() -> None:
    backend = EmulatedBackend()
    manager = SlotManager(backend, _storages())
    _run(manager, backend, [0], [0, 1, 2, 3])
    stats = manager.end_forward()
    assert stats.transfers == 3 and stats.discarded == 2  # 1 and 2 were loaded and never used


def test_backend_for() -> None:
    assert backend_for(torch.device("cpu")).emulated is True
    with pytest.raises(ValueError, match="meta"):
        backend_for(torch.device("meta"))
    with pytest.raises(ValueError):
        SlotManager(EmulatedBackend(), _storages(), num_slots=0)
