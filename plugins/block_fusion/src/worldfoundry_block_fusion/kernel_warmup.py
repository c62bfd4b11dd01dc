"""When the fused blocks' kernels compile: before the first fused call (``blocking``) or beside eager calls
(``background``).

A block's first fused call needs its kernel variants compiled. On a machine whose Triton cache does not hold them
yet that takes seconds (about 4 s for a Wan block on an H200 host, ``benchmarks/profiling/first_call_cost.py``);
later processes find them on disk (about 0.6 s). The option ``kernel_compile`` chooses who waits:

* ``blocking``: the first eligible block records the variants it will launch, compiles them concurrently and then
  runs fused -- the first call takes the compilation's time;
* ``background``: the variants are recorded the same way, compiled on a background thread, and until they are
  ready every block runs its original forward, counted as a fallback with :data:`REASON_COMPILING` -- the first
  calls run at eager speed, and the results are the same bits either way (the fused path is bitwise eager).
  :meth:`KernelWarmup.wait` (``AccelerationSession.wait_ready()``) waits for the kernels;
* ``auto`` (default): the process default of
  :func:`~worldfoundry.core.fusion.compile_pool.default_compile_mode` (``background`` unless changed).

Where nothing compiles (Triton's interpreter, no Triton, no CUDA) both modes are the same: nothing waits. A process
forked while a compilation runs has no compile thread: nothing is pending there (its first fused calls compile
what they need).

Beside ``cuda_graph`` (:meth:`KernelWarmup.graph_key`): before the first block ran and while the kernels compile,
a call runs eagerly (never captured); the number of finished background compilations is part of the captured
signature, so a graph captured before the kernels were ready (a first eligible call inside a capture's warm-up) is
not replayed once they are.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from worldfoundry.core.fusion.compile_pool import compile_concurrently, default_compile_mode
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled
from worldfoundry_block_fusion.options import KERNEL_COMPILE_MODES

logger = logging.getLogger(__name__)

#: The fallback reason of a block that ran its original forward while the kernels compile in the background.
REASON_COMPILING: Final = "kernels compiling in the background (the original forward runs meanwhile; same bits)"

Jobs = Sequence[tuple[Any, tuple[Any, ...]]]

#: Every live :class:`KernelWarmup` (a forked child has none of their compile threads: see :func:`_after_fork`).
_INSTANCES: weakref.WeakSet[KernelWarmup] = weakref.WeakSet()


def _after_fork() -> None:
    """In a forked child: compilations the parent ran in the background never finish here, so none is pending
    (the child's first fused calls compile what they need, as in ``blocking``)."""
    for warmup in list(_INSTANCES):
        warmup._thread = None
        warmup._done.set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def kernels_compile_here() -> bool:
    """Whether fusion kernels are compiled to machine code in this process (Triton on CUDA, no interpreter)."""
    return TRITON_AVAILABLE and not interpreter_enabled() and torch.cuda.is_available()


class KernelWarmup:
    """Compiles recorded kernel variants now or in the background, and says whether they are ready.

    Args:
        mode: ``auto``, ``background`` or ``blocking`` (``auto`` is resolved when compilation starts).
        compile_fn: compiles a list of recorded ``(launcher, arguments)`` jobs (default:
            :func:`~worldfoundry.core.fusion.compile_pool.compile_concurrently`).
    """

    def __init__(self, mode: str = "auto", compile_fn: Callable[[Jobs], None] | None = None) -> None:
        if mode not in KERNEL_COMPILE_MODES:
            raise ValueError(f"kernel_compile must be one of {KERNEL_COMPILE_MODES}, got {mode!r}")
        self.mode = mode
        #: what compiles the recorded jobs
        self.compile_fn = compile_fn or compile_concurrently
        #: a compilation was started (the first eligible block recorded its variants)
        self.started = False
        #: a block ran that could not be fused (set by the runtime): a forward has been seen
        self.seen = False
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._done.set()
        #: finished background compilations: part of a CUDA graph's signature (a blocking compilation finishes
        #: inside the forward, before any fused call, so a graph captured around it is fused already)
        self.generation = 0
        #: seconds the last compilation took (``None`` before the first)
        self.seconds: float | None = None
        _INSTANCES.add(self)

    def resolved_mode(self) -> str:
        """``background`` or ``blocking`` (``auto`` resolved to the process default)."""
        return default_compile_mode() if self.mode == "auto" else self.mode

    def start(self, jobs: Jobs) -> None:
        """Compile ``jobs``: now (``blocking``) or on a background thread; nothing when there are none."""
        if not jobs or not kernels_compile_here():
            return
        self.started = True
        if self.resolved_mode() == "blocking":
            self._run(list(jobs))
            return
        self._done.clear()
        device = next((a.device for _, args in jobs for a in args if isinstance(a, torch.Tensor)), None)
        self._thread = threading.Thread(target=self._background, args=(list(jobs), device), daemon=True,
                                        name="worldfoundry-block-fusion-compile")
        self._thread.start()

    def _background(self, jobs: list[tuple[Any, tuple[Any, ...]]], device: torch.device | None) -> None:
        try:
            if device is not None and device.type == "cuda":
                with torch.cuda.device(device):
                    self._run(jobs)
            else:
                self._run(jobs)
            self.generation += 1
        except Exception as exc:  # noqa: BLE001 - the kernels then compile on first use, in the calling thread
            logger.warning("block_fusion: compiling the kernels in the background failed (%s: %s); they compile "
                           "on first use", type(exc).__name__, exc)
        finally:
            self._done.set()

    def _run(self, jobs: list[tuple[Any, tuple[Any, ...]]]) -> None:
        start = time.perf_counter()
        self.compile_fn(jobs)
        self.seconds = time.perf_counter() - start

    def pending(self) -> bool:
        """Whether a background compilation is still running."""
        return not self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a running background compilation; ``True`` when none is running (any more)."""
        return self._done.wait(timeout)

    def awaiting_first(self) -> bool:
        """Whether the first fused forward is still to come while kernels will compile in the background: no block
        has run yet (a graph captured now would hold the original forwards until the kernels are ready)."""
        return (not self.started and not self.seen and self.resolved_mode() == "background"
                and kernels_compile_here())

    def graph_key(self) -> tuple[str, int]:
        """What a CUDA graph's signature holds of this state (changes when a compilation finishes)."""
        return ("kernel_compile", self.generation)

    def report(self) -> dict[str, Any]:
        """The mode, the state and the last compilation's seconds (for the execution report)."""
        return {"kernel_compile": self.resolved_mode(), "kernels_pending": self.pending(),
                "compile_seconds": None if self.seconds is None else round(self.seconds, 3)}


__all__ = ["REASON_COMPILING", "KernelWarmup", "kernels_compile_here"]
