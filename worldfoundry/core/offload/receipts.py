"""Per-request offload receipts: data only (no tensors), bounded, JSON-serialisable."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

#: Per-forward transfer counts kept in one receipt.
MAX_FORWARDS_LISTED = 256


@dataclass(frozen=True)
class OffloadRequestReceipt:
    """What block offloading did during one request.

    Attributes:
        request_id: the request (``"<no-request>"`` for a forward outside any request).
        emulated: ``True`` when CPU emulated host and device (events emulated, times are CPU copy times).
        device: the compute device.
        layout: ``"contiguous"`` (one slab and one copy per block) or ``"per_tensor"``.
        num_blocks / resident_count / resident_indices: N, r and which blocks were resident.
        forwards: model forwards run in the request; ``failed_forwards`` of them raised.
        transfers: blocks copied into slots (``transfers_per_forward`` lists them per forward, bounded).
        bytes_copied / copy_calls: slot traffic (resident builds are counted separately).
        copy_wait_ms: time the compute stream waited for slot copies (CUDA events; emulated: copy time).
        resident_bytes / slot_bytes: device bytes held by resident copies and by the slots.
        resident_builds / resident_bytes_copied: how often the resident set was built and what it copied.
        misses / discarded: blocks loaded on demand / prefetched blocks dropped unused.
        first_forward_transfers: ``[block, slot]`` in transfer order for the request's first forward.
        weights_written_back: resident blocks whose parameters were written in place during the request
            (their values were copied back to the host masters at release).
    """

    request_id: str
    emulated: bool
    device: str
    layout: str
    num_blocks: int
    resident_count: int
    resident_indices: tuple[int, ...]
    forwards: int
    failed_forwards: int
    transfers: int
    transfers_per_forward: tuple[int, ...]
    bytes_copied: int
    copy_calls: int
    copy_wait_ms: float
    resident_bytes: int
    slot_bytes: int
    resident_builds: int
    resident_bytes_copied: int
    misses: int
    discarded: int
    first_forward_transfers: tuple[tuple[int, int], ...]
    weights_written_back: int = 0

    @property
    def streamed_blocks(self) -> int:
        """N − r."""
        return self.num_blocks - self.resident_count

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "first_forward_transfers":
                value = [list(pair) for pair in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        out["streamed_blocks"] = self.streamed_blocks
        out["device_bytes"] = self.resident_bytes + self.slot_bytes
        return out
