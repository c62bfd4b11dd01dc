"""The active ``cuda_graph`` on one model: the wrapped forward, its :class:`GraphRunner` and its receipts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

from worldfoundry.core.acceleration.cuda_graph import GraphRunner
from worldfoundry.plugin import ExecutionLedger, PatchRecorder, RecordedHandle
from worldfoundry_cuda_graph.options import PLUGIN_NAME


class CudaGraphHandle(RecordedHandle):
    """Undoes the forward wrapper; frees every graph, pool and buffer on uninstall; reports per request.

    Receipts (per request): ``executed("<root>", "capture" | "replay")``, eager calls as
    ``fallback("<root>", reason)``, counters ``captures``, ``evictions``, ``invalidations``, ``capture_failures``
    and the note ``pool_bytes``; ``execution_report()["graphs"]`` lists the captured signatures with their replays,
    capture time, pool and static-buffer bytes.
    """

    def __init__(self, patches: PatchRecorder, ledger: ExecutionLedger, runner: GraphRunner) -> None:
        super().__init__(PLUGIN_NAME, patches, ledger)
        self.runner = runner

    def end_request(self, request_id: str) -> None:
        self.ledger.note("pool_bytes", self.runner.pool_bytes(), request_id=request_id)
        self.ledger.note("signatures", len(self.runner.report()["signatures"]), request_id=request_id)
        self.ledger.finish(request_id)

    def release(self) -> None:
        self.runner.release()

    def execution_report(self) -> dict[str, Any]:
        report = super().execution_report()
        report["graphs"] = self.runner.report()
        return report


def graph_forward(runner: GraphRunner, original: Callable[..., Any]) -> Callable[..., Any]:
    """The model's ``forward`` replaced by one that replays, captures or runs ``original`` eagerly."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        return runner(original, args, kwargs)

    return forward


def install(model: nn.Module, runner: GraphRunner, marker: str) -> PatchRecorder:
    """Wrap ``model.forward`` and set the CUDA-graph marker (recorded; undone by the handle)."""
    with PatchRecorder(PLUGIN_NAME) as recorder:
        recorder.wrap_forward(model, lambda original: graph_forward(runner, original), name=PLUGIN_NAME)
        recorder.setattr(model, marker, True)
        return recorder.pop_all()


__all__ = ["CudaGraphHandle", "graph_forward", "install"]
