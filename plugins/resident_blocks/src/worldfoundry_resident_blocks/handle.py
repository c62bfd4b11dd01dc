"""Activation of ``resident_blocks``: wrap block forwards and the model's forward boundaries around the engine."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

from worldfoundry.base_models.diffusion_model.optimizations.guards import install_call_refusals, install_move_guard
from worldfoundry.core.offload.block_offload import BlockOffloadEngine, ForwardOutcome
from worldfoundry.core.offload.receipts import OffloadRequestReceipt
from worldfoundry.plugin import ExecutionLedger, PatchRecorder, RecordedHandle, current_request_id
from worldfoundry_resident_blocks.options import NAME

logger = logging.getLogger(__name__)

#: Patch name on every wrapped block forward.
PATCH_NAME = NAME
#: Ledger ``executed`` kinds.
KIND_RESIDENT = "resident"
KIND_STREAMED = "streamed"


class ResidentBlocksHandle(RecordedHandle):
    """The active offload. ``deactivate()`` unwraps the blocks and puts every weight back on the device."""

    def __init__(self, engine: BlockOffloadEngine, ledger: ExecutionLedger) -> None:
        super().__init__(NAME, PatchRecorder(NAME), ledger)
        self.engine = engine
        self.receipts: dict[str, OffloadRequestReceipt] = {}
        # Block executions are counted here on the hot path and folded into the ledger at request end
        # (and before any report), so a block call costs a dict increment instead of a locked ledger update.
        self._pending: dict[tuple[int, str], int] = {}
        self._pending_request: str | None = None
        self._paths: dict[int, str] = {}

    # ------------------------------------------------------------------ facts
    def _facts(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "num_blocks": engine.num_blocks,
            "resident_count": len(engine.resident_indices),
            "resident_indices": list(engine.resident_indices),
            "layout": engine.layout_name,
            "emulated": engine.emulated,
            "device": str(engine.device),
            "block_bytes": sum(engine.block_bytes),
        }

    def _request_id(self) -> str:
        return self.engine.active_request_id or current_request_id()

    # ------------------------------------------------------------------ requests
    def begin_request(self, request_id: str) -> None:
        self.engine.begin_request(request_id)
        self.ledger.note("offload_setup", self._facts(), request_id=request_id)

    def flush_executions(self) -> None:
        """Fold the block executions counted since the last flush into the ledger."""
        pending, self._pending = self._pending, {}
        request_id, self._pending_request = self._pending_request, None
        for (index, kind), n in pending.items():
            self.ledger.executed(self._paths[index], kind, n, request_id=request_id)

    def end_request(self, request_id: str) -> None:
        self.flush_executions()
        receipt = self.engine.end_request(request_id)
        if receipt is not None:
            self._record_receipt(receipt, request_id)
        self.ledger.finish(request_id)

    def _record_receipt(self, receipt: OffloadRequestReceipt, request_id: str) -> None:
        self.receipts[request_id] = receipt
        while len(self.receipts) > self.ledger.max_requests:
            self.receipts.pop(next(iter(self.receipts)))
        self.ledger.note("offload", receipt.to_json(), request_id=request_id)
        self.ledger.count("resident_builds", receipt.resident_builds, request_id=request_id)

    # ------------------------------------------------------------------ forwards
    def on_forward_start(self, module: nn.Module, args: Any) -> None:
        """Model forward pre-hook."""
        self.engine.begin_forward()

    def on_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        """Model forward hook (always called, also when the forward raised)."""
        failed = output is None and sys.exc_info()[0] is not None
        request_id = self._request_id()
        outcome = self.engine.end_forward(failed=failed)
        self._record_forward(outcome, request_id)

    def _record_forward(self, outcome: ForwardOutcome, request_id: str) -> None:
        stats = outcome.transfers
        self.ledger.count("forwards", request_id=request_id)
        self.ledger.count("transfers", stats.transfers, request_id=request_id)
        self.ledger.count("bytes_copied", stats.bytes_copied, request_id=request_id)
        self.ledger.count("copy_calls", stats.copy_calls, request_id=request_id)
        if stats.misses:
            self.ledger.count("prefetch_misses", stats.misses, request_id=request_id)
        if stats.discarded:
            self.ledger.count("discarded_prefetches", stats.discarded, request_id=request_id)
        if outcome.receipt is not None:  # the forward was its own request
            self.flush_executions()
            self._record_receipt(outcome.receipt, request_id)

    def run_block(self, index: int, path: str, call: Callable[[], Any]) -> Any:
        """Run one block's own forward with its weights on the device (a standalone call is its own forward)."""
        engine = self.engine
        if not engine.in_forward:
            request_id = self._request_id()
            engine.begin_forward(only=index)
            failed = True
            try:
                result = self.run_block(index, path, call)
                failed = False
                return result
            finally:
                self._record_forward(engine.end_forward(failed=failed), request_id)
        result = engine.run_block(index, call)
        request_id = self._request_id()
        if request_id != self._pending_request:
            if self._pending:
                self.flush_executions()
            self._pending_request = request_id
        key = (index, KIND_RESIDENT if index in engine.resident_set else KIND_STREAMED)
        self._paths[index] = path
        self._pending[key] = self._pending.get(key, 0) + 1
        return result

    # ------------------------------------------------------------------ reports
    def release(self) -> None:
        self.engine.close()

    def execution_report(self) -> dict[str, Any]:
        self.flush_executions()
        report = super().execution_report()
        report["offload"] = self._facts()
        report["device_bytes"] = self.engine.device_bytes() if self.active else {"total": 0}
        report["host_bytes"] = self.engine.host_bytes if self.active else 0
        report["pinned_bytes"] = self.engine.pinned_bytes if self.active else 0
        report["pin_method"] = self.engine.pin_method if self.active else None
        return report


def _block_wrapper(handle: ResidentBlocksHandle, index: int,
                   path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return handle.run_block(index, path, lambda: original(*args, **kwargs))

        return forward

    return make


#: diffusers features that change where or in which dtype block weights live (the plugin owns that while active).
OFFLOAD_REFUSED_CALLS = {
    "enable_layerwise_casting": "it recasts the block weights resident_blocks keeps on the host",
    "enable_group_offload": "it offloads the blocks resident_blocks already streams",
}


def activate_resident_blocks(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]],
                             resident_indices: Sequence[int], *, contiguous: bool, device: Any) -> ResidentBlocksHandle:
    """Move every block's weights to host masters and wrap the forwards (recorded, reversible).

    Returns:
        The :class:`ResidentBlocksHandle`.
    """
    engine = BlockOffloadEngine(blocks, resident_indices, contiguous=contiguous, device=device, owner=NAME)
    handle = ResidentBlocksHandle(engine, ExecutionLedger(NAME))
    with PatchRecorder(NAME) as recorder:
        # Registered first so it is undone last: weights return after the wrappers and hooks are gone.
        recorder.callback(engine.restore, "restore block weights to the device")
        engine.offload()
        for index, (path, block) in enumerate(blocks):
            recorder.wrap_forward(block, _block_wrapper(handle, index, path), name=PATCH_NAME)
        # Moves would go around the host masters and leave uninstall nothing consistent to give back.
        install_move_guard(recorder, model, dict(blocks), plugin=NAME)
        install_call_refusals(recorder, model, OFFLOAD_REFUSED_CALLS, plugin=NAME)
        recorder.hook(model.register_forward_pre_hook(handle.on_forward_start), "resident_blocks forward start")
        recorder.hook(model.register_forward_hook(handle.on_forward_end, always_call=True),
                      "resident_blocks forward end")
        handle.patches = recorder.pop_all()
    return handle
