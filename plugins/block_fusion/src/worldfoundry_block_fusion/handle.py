"""Handle and receipts of the block-fusion plugins.

A fused call is counted with one dict increment keyed by (request id, module path, chain) -- cheap enough for a
forward that launches a few hundred kernels -- and folded into the :class:`ExecutionLedger` when a request ends
or a report is read: ``executed(path, chain, n)`` per block and chain (the ledger also totals each chain per
request under ``counters``). Fallbacks (the original torch operations ran instead) go to the ledger at once, with their reason.
Counts are exact for forwards that do not overlap a report being read.
"""

from __future__ import annotations

import threading
from typing import Any

from worldfoundry.core.acceleration.context import current_request_id
from worldfoundry.plugin import ExecutionLedger, PatchRecorder, RecordedHandle


class FusionCounters:
    """Per (request, module, chain) counts of fused kernel calls, folded into a ledger on demand."""

    def __init__(self, ledger: ExecutionLedger) -> None:
        self.ledger = ledger
        self._pending: dict[tuple[str, str, str], int] = {}
        self._lock = threading.Lock()

    def fused(self, path: str, chain: str, request_id: str | None = None) -> None:
        key = (request_id if request_id is not None else current_request_id(), path, chain)
        pending = self._pending
        pending[key] = pending.get(key, 0) + 1

    def fallback(self, path: str, reason: str, request_id: str | None = None) -> None:
        self.ledger.fallback(path, reason, request_id=request_id if request_id is not None else current_request_id())

    def fold(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for (rid, path, chain), n in pending.items():
            self.ledger.executed(path, chain, n, request_id=rid)


class BlockFusionHandle(RecordedHandle):
    """Undoes the replaced forwards/processors; reports fused calls per chain and fallbacks per request."""

    def __init__(self, name: str, counters: FusionCounters, *, chains: tuple[str, ...], blocks: list[str],
                 notes: dict[str, Any]) -> None:
        super().__init__(name, PatchRecorder(name), counters.ledger)
        self.counters = counters
        self.chains = chains
        self.blocks = blocks
        self.notes = notes

    def end_request(self, request_id: str) -> None:
        self.counters.fold()
        self.ledger.finish(request_id)

    def release(self) -> None:
        self.counters.fold()

    def execution_report(self) -> dict[str, Any]:
        self.counters.fold()
        report = super().execution_report()
        report["chains"] = list(self.chains)
        report["fused_blocks"] = len(self.blocks)
        report.update(self.notes)
        return report


__all__ = ["BlockFusionHandle", "FusionCounters"]
