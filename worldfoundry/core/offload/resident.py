"""The resident set: device copies of the r chosen blocks, built once per request and released at its end."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from worldfoundry.core.offload.host_storage import HostBlockStorage
from worldfoundry.core.offload.streams import OffloadBackend


class ResidentSet:
    """Device copies of ``indices`` built from their host masters.

    :meth:`build` allocates one buffer per block (on the compute stream), orders the copy stream after the
    compute stream, copies every block on the copy stream and makes the compute stream wait for the copies:
    no host synchronisation. :meth:`release` drops the buffers after ordering the compute stream behind
    every copy, so their memory is reused safely.
    """

    def __init__(self, backend: OffloadBackend, storages: Mapping[int, HostBlockStorage],
                 indices: Sequence[int]) -> None:
        self.backend = backend
        self.storages = storages
        self.indices = tuple(indices)
        self._buffers: dict[int, torch.Tensor] = {}
        self._views: dict[int, list[torch.Tensor]] = {}
        self._gate = backend.new_event("resident.gate")
        self._done = backend.new_event("resident.ready")
        self.bytes_copied = 0
        self.copy_calls = 0

    @property
    def built(self) -> bool:
        return bool(self._buffers) or not self.indices

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def views(self, index: int) -> list[torch.Tensor]:
        return self._views[index]

    def build(self, compute_stream: Any) -> dict[int, list[torch.Tensor]]:
        """Copy every resident block to the device. Returns block index -> tensors (views), in layout order.

        On failure (e.g. out of device memory) everything allocated so far is released and the error
        propagates.
        """
        if self._buffers:
            return dict(self._views)
        self.bytes_copied = 0
        self.copy_calls = 0
        if not self.indices:
            return {}
        try:
            for index in self.indices:
                storage = self.storages[index]
                buffer = self.backend.empty(storage.layout.nbytes)
                self._buffers[index] = buffer
                self._views[index] = storage.layout.views(buffer)
            self.backend.record(self._gate, compute_stream)
            emulated = self.backend.emulated
            with self.backend.copy_context():
                copy_stream = self.backend.current_stream()
                self.backend.wait(copy_stream, self._gate)
                for index in self.indices:
                    storage = self.storages[index]
                    storage.copy_to(self._buffers[index], self._views[index], non_blocking=not emulated)
                    self.bytes_copied += storage.nbytes
                    self.copy_calls += storage.copies_per_load
                self.backend.record(self._done, copy_stream)
            self.backend.wait(compute_stream, self._done)
        except BaseException:
            self.release(compute_stream)
            raise
        return dict(self._views)

    def release(self, compute_stream: Any) -> None:
        """Drop the device copies (the caller has pointed the parameters back at their host masters)."""
        if self._buffers:
            self.backend.order_after_copies(compute_stream)
        self._buffers.clear()
        self._views.clear()
