"""Handle and receipts of the block-fusion plugins.

A fused call is counted with a plain integer increment in its block's :class:`BlockCounts` (a list indexed by
chain); the block remembers the request its counts belong to and moves them aside when a call of another request
arrives. The counts are folded into the :class:`ExecutionLedger` when a request ends, a report is read or a CUDA
graph captures (``fold_counts``): ``executed(path, chain, n)`` per block and chain (the ledger also totals each
chain per request under ``counters``). Fallbacks (the original torch operations ran instead) go to the ledger at
once, with their reason. Counts are exact for forwards that do not overlap a report being read.

Beside ``cuda_graph`` the fused forwards are captured as they are (no per-call Python state beyond the counts and
the float32 carry, which lives inside one forward): the graph runner folds the counts inside the capture, keeps
those ledger calls and applies them once per replay for the replaying request, so receipts count every replayed
fused call.
"""

from __future__ import annotations

import threading
from typing import Any

from worldfoundry.core.acceleration.context import current_request_id
from worldfoundry.core.acceleration.cuda_graph.participants import GraphCall
from worldfoundry.plugin import ExecutionLedger, PatchRecorder, RecordedHandle
from worldfoundry_block_fusion.kernel_warmup import REASON_COMPILING


#: Every chain name of both plugins, in the index order of :attr:`BlockCounts.counts`.
CHAIN_INDEX: dict[str, int] = {name: i for i, name in enumerate(
    ("modulate", "gated_residual", "cross_residual", "rope", "float_carry", "linear_attention", "glu", "layer_norm",
     "qk_norm"))}
(MODULATE, GATED_RESIDUAL, CROSS_RESIDUAL, ROPE, FLOAT_CARRY, LINEAR_ATTENTION, GLU, LAYER_NORM,
 QK_NORM) = range(len(CHAIN_INDEX))
_CHAIN_NAMES = tuple(CHAIN_INDEX)


class BlockCounts:
    """Plain-integer counts of one block's fused calls, for the request :attr:`rid` (see the module docstring).

    Hot path: ``if rid != counts.rid: counters.switch(counts, rid)`` once per call, then ``counts.counts[i] += 1``.
    """

    __slots__ = ("counts", "path", "rid")

    def __init__(self, path: str) -> None:
        self.path = path
        self.rid: str | None = None
        self.counts = [0] * len(_CHAIN_NAMES)


class FusionCounters:
    """Per (request, module, chain) counts of fused kernel calls, folded into a ledger on demand."""

    def __init__(self, ledger: ExecutionLedger) -> None:
        self.ledger = ledger
        self._pending: dict[tuple[str, str, str], int] = {}
        self._blocks: list[BlockCounts] = []
        self._lock = threading.Lock()

    def block(self, path: str) -> BlockCounts:
        """The plain counters of the block at ``path`` (created once, at activation)."""
        counts = BlockCounts(path)
        self._blocks.append(counts)
        return counts

    def switch(self, counts: BlockCounts, rid: str) -> None:
        """Move ``counts`` aside for their request, then count for ``rid``."""
        self._move(counts)
        counts.rid = rid

    def _move(self, counts: BlockCounts) -> None:
        values, rid = counts.counts, counts.rid
        if rid is None:
            return
        pending = self._pending
        for i, n in enumerate(values):
            if n:
                values[i] = 0
                key = (rid, counts.path, _CHAIN_NAMES[i])
                pending[key] = pending.get(key, 0) + n

    def fused(self, path: str, chain: str, request_id: str | None = None) -> None:
        key = (request_id if request_id is not None else current_request_id(), path, chain)
        pending = self._pending
        pending[key] = pending.get(key, 0) + 1

    def fallback(self, path: str, reason: str, request_id: str | None = None) -> None:
        self.ledger.fallback(path, reason, request_id=request_id if request_id is not None else current_request_id())

    def fold(self) -> None:
        with self._lock:
            for counts in self._blocks:
                self._move(counts)
            pending, self._pending = self._pending, {}
        for (rid, path, chain), n in pending.items():
            self.ledger.executed(path, chain, n, request_id=rid)


class BlockFusionHandle(RecordedHandle):
    """Undoes the replaced forwards/processors; reports fused calls per chain and fallbacks per request."""

    #: the fused forwards have no per-call Python state a CUDA-graph replay would skip, beyond the counts that
    #: :meth:`fold_counts` hands to the (diverted) ledger during a capture (and whether the kernels are ready:
    #: :meth:`graph_call`)
    cuda_graph_safe = True

    def __init__(self, name: str, counters: FusionCounters, *, chains: tuple[str, ...], blocks: list[str],
                 notes: dict[str, Any], kernels: Any = None) -> None:
        super().__init__(name, PatchRecorder(name), counters.ledger)
        self.counters = counters
        self.chains = chains
        self.blocks = blocks
        self.notes = notes
        #: the :class:`~worldfoundry_block_fusion.kernel_warmup.KernelWarmup` of the fused blocks
        self.kernels = kernels

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for kernels compiling in the background (``kernel_compile: background``); ``True`` once none is."""
        return True if self.kernels is None else self.kernels.wait(timeout)

    def graph_call(self) -> Any:
        """Beside ``cuda_graph``: run eagerly while the kernels compile; key graphs by finished compilations."""
        if self.kernels is None:
            return None
        if self.kernels.pending() or self.kernels.awaiting_first():
            return GraphCall(eager_reason=REASON_COMPILING)
        return GraphCall(key=self.kernels.graph_key())

    def fold_counts(self) -> None:
        """Fold the plain counters into the ledger (the CUDA-graph runner calls it around a capture)."""
        self.counters.fold()

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
        if self.kernels is not None:
            report.update(self.kernels.report())
        return report


__all__ = ["CHAIN_INDEX", "GLU", "BlockCounts", "BlockFusionHandle", "FusionCounters"]
