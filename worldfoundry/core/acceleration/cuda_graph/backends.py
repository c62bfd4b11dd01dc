"""Capture backends: how a forward becomes something that can be replayed.

:class:`CudaGraphBackend` records the forward into a ``torch.cuda.CUDAGraph`` with a private memory pool (one per
signature, so evicting a signature frees exactly its memory), after a warm-up on the same side stream the capture
uses. :class:`EagerReplayBackend` is a real executor for machines without CUDA: "capture" runs the forward once
into static outputs and "replay" runs the eager forward again on the static inputs and copies the result into
those outputs. It re-runs Python, so it is used to test everything around capture (signatures, eviction,
invalidation, receipts, aliasing, plugin state) on the CPU; the graph runner also checks on it that a replay makes
exactly the ledger calls the capture made (what a frozen graph assumes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten

#: The reason calls run eagerly on a machine without CUDA.
NO_CUDA_DEVICE = "no CUDA device"


class CapturedForward(Protocol):
    """A recorded forward: ``outputs`` (static tensors, as the forward returned them), ``replay()``,
    ``pool_bytes`` (device memory the capture added) and ``release()``."""

    outputs: Any
    pool_bytes: int

    def replay(self) -> None:
        ...

    def release(self) -> None:
        ...


class GraphBackend(Protocol):
    """What the graph runner needs from a capture backend."""

    name: str
    #: whether ``replay`` runs the forward's Python again (test executors)
    reruns_python: bool
    #: whether CPU input buffers should be page-locked
    pins_host_memory: bool

    def unavailable(self, device: torch.device) -> str | None:
        ...

    def warm_up(self, run: Callable[[], Any], device: torch.device) -> Any:
        ...

    def capture(self, run: Callable[[], Any], device: torch.device) -> CapturedForward:
        ...


class _CudaCaptured:
    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: Any, pool: Any, pool_bytes: int) -> None:
        self.graph: torch.cuda.CUDAGraph | None = graph
        self.outputs = outputs
        self.pool = pool
        self.pool_bytes = pool_bytes

    def replay(self) -> None:
        if self.graph is None:
            raise RuntimeError("the captured graph was released")
        self.graph.replay()

    def release(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.outputs = None
        self.pool = None


class CudaGraphBackend:
    """CUDA graphs with a private pool per capture and one side stream per device for warm-up and capture."""

    name = "cuda"  # the capture backend (receipts: "backend"); "eager_replay" re-runs the eager forward (CPU)
    reruns_python = False
    pins_host_memory = True

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def unavailable(self, device: torch.device) -> str | None:
        if not torch.cuda.is_available():
            return NO_CUDA_DEVICE
        if device.type != "cuda":
            return f"the model is on {device}, not a CUDA device"
        return None

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def warm_up(self, run: Callable[[], Any], device: torch.device) -> Any:
        """Run the forward eagerly on the capture's side stream (lazy initialisation happens outside capture)."""
        with torch.cuda.device(device):
            stream, current = self._stream(device), torch.cuda.current_stream()
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                out = run()
            current.wait_stream(stream)
        return out

    def capture(self, run: Callable[[], Any], device: torch.device) -> _CudaCaptured:
        with torch.cuda.device(device):
            stream, current = self._stream(device), torch.cuda.current_stream()
            torch.cuda.synchronize()
            before = torch.cuda.memory_reserved()
            pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool)
                try:
                    out = run()
                except BaseException:
                    with contextlib.suppress(Exception):
                        graph.capture_end()
                    raise
                graph.capture_end()
            current.wait_stream(stream)
            torch.cuda.synchronize()
            added = torch.cuda.memory_reserved() - before
        return _CudaCaptured(graph, out, pool, max(added, 0))


class _Replayed:
    def __init__(self, run: Callable[[], Any], outputs: Any) -> None:
        self._run: Callable[[], Any] | None = run
        self.outputs = outputs
        leaves, _ = tree_flatten(outputs)
        self._leaves = [t for t in leaves if isinstance(t, torch.Tensor)]
        self.pool_bytes = sum(t.untyped_storage().nbytes() for t in self._leaves)

    def replay(self) -> None:
        if self._run is None:
            raise RuntimeError("the captured forward was released")
        fresh, _ = tree_flatten(self._run())
        fresh = [t for t in fresh if isinstance(t, torch.Tensor)]
        if [t.shape for t in fresh] != [t.shape for t in self._leaves]:
            raise RuntimeError("a replay produced outputs of another layout than its capture")
        with torch.no_grad():
            for static, new in zip(self._leaves, fresh, strict=True):
                static.copy_(new)

    def release(self) -> None:
        self._run = None
        self.outputs = None
        self._leaves = []


class EagerReplayBackend:
    """Re-runs the eager forward as its "replay" (any device). For tests and CPU-only validation."""

    name = "eager_replay"
    reruns_python = True
    pins_host_memory = False

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def warm_up(self, run: Callable[[], Any], device: torch.device) -> Any:
        return run()

    def capture(self, run: Callable[[], Any], device: torch.device) -> _Replayed:
        return _Replayed(run, run())


__all__ = ["NO_CUDA_DEVICE", "CapturedForward", "CudaGraphBackend", "EagerReplayBackend", "GraphBackend"]
