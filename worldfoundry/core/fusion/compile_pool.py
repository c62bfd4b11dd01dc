"""Compiling the fusion kernels ahead of their first launch: concurrently, and ready to launch when done.

A fused block's first call needs four to seven kernel variants. Left to first use they compile one after
another on the calling thread, and each then builds its launcher (a C module compiled with the system compiler,
in Triton 3.x before 3.5) and loads its binary on the device, again one after another. Measured on an H200 host
(``benchmarks/profiling/first_call_cost.py``, cold Triton cache): 1.9 s of compilation on six threads, then five
launcher builds of 0.24-0.39 s each, in sequence, on the calling thread. Here:

* :func:`warm_compiler` (when a fusion plugin is activated) starts, in background threads, what every first
  compilation of a process waits for: Triton's compiler key (a hash of its own sources and of ``libtriton``, the
  GIL released), the import of its code generator, and the device driver's utility module (built with the
  system compiler on a machine's first run) -- concurrently;
* :func:`compile_concurrently` compiles the recorded launches on a thread pool (Triton's ``AsyncCompileMode``)
  and, in the same worker right after each compilation, builds that kernel's launcher and loads its binary on
  the device of its tensors, so the launcher builds run side by side and overlap the other compilations. The
  variants whose kernels have the longest sources (the norm and rotary kernels, the slowest to compile) are
  submitted first, so that they do not queue behind the short ones for the interpreter lock of the code
  generator.

Nothing here changes what is compiled: the same ``JITFunction.warmup`` calls fill the same caches with the same
machine code a first launch would produce. A failure anywhere is logged and leaves the work to the first launch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Final

import torch

from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

logger = logging.getLogger(__name__)

#: Compile threads (a Wan or SANA-Video block needs four to seven variants).
PRECOMPILE_WORKERS: Final = 8

#: How fusion plugins compile their kernels by default (their ``kernel_compile: auto``): ``background`` (the
#: original forward runs until the kernels are ready) or ``blocking`` (the first fused call waits for them).
COMPILE_MODES: Final = ("background", "blocking")
_MODE: list[str] = ["background"]

#: The background threads of :func:`warm_compiler` (empty: not started).
_WARM: list[threading.Thread] = []
_WARM_LOCK = threading.Lock()


def default_compile_mode() -> str:
    """The process default of the fusion plugins' ``kernel_compile: auto`` (see :data:`COMPILE_MODES`)."""
    return _MODE[0]


def set_default_compile_mode(mode: str) -> str:
    """Set the process default of ``kernel_compile: auto``; returns the previous one.

    Example:
        >>> previous = set_default_compile_mode("blocking")
        >>> default_compile_mode()
        'blocking'
        >>> _ = set_default_compile_mode(previous)

    Raises:
        ValueError: ``mode`` is not one of :data:`COMPILE_MODES`.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    previous, _MODE[0] = _MODE[0], mode
    return previous


def _warm_key() -> None:
    from triton.runtime.cache import triton_key

    triton_key()
    import triton.compiler.code_generator  # noqa: F401


def _warm_driver() -> None:
    from triton.runtime.driver import driver

    driver.active.get_current_target()  # creating the driver builds (or loads) its utility module


def _guarded(work: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - an optimisation only
            logger.debug("warming Triton (%s) failed: %s: %s", work.__name__, type(exc).__name__, exc)

    return run


def warm_compiler() -> None:
    """Start, once per process, the background threads that prepare Triton for a first compilation.

    Does nothing under the interpreter or without Triton; the driver is prepared only where CUDA is available. A
    failure is logged at debug level (the first compilation then does the work itself).
    """
    with _WARM_LOCK:
        if _WARM or not TRITON_AVAILABLE or interpreter_enabled():
            return
        works = [_warm_key]
        if torch.cuda.is_available():
            works.append(_warm_driver)
        for work in works:
            thread = threading.Thread(target=_guarded(work), name=f"worldfoundry-triton{work.__name__}", daemon=True)
            _WARM.append(thread)
            thread.start()


def wait_warm() -> None:
    """Let running :func:`warm_compiler` threads finish (so their work is not done twice, or raced)."""
    for thread in list(_WARM):
        if thread.is_alive():
            thread.join()


class _CompileAndLoad(Executor):
    """An executor for ``AsyncCompileMode`` whose tasks also ready each compiled kernel for launching."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.device: int | None = None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        device = self.device

        def task() -> Any:
            kernel = fn(*args, **kwargs)
            try:
                if device is None:
                    kernel.run  # noqa: B018 - the property builds the launcher and loads the binary
                else:
                    with torch.cuda.device(device):
                        kernel.run  # noqa: B018
            except Exception as exc:  # noqa: BLE001 - the first launch loads it again and raises a real error
                logger.debug("loading a precompiled fusion kernel failed: %s: %s", type(exc).__name__, exc)
            return kernel

        return self.pool.submit(task)


def _device_of(args: Sequence[Any]) -> int | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.index if a.device.type == "cuda" else None
    return None


def _source_length(job: tuple[Any, tuple[Any, ...]]) -> int:
    fn = getattr(job[0], "fn", None)
    return len(getattr(fn, "src", "") or "")


def compile_concurrently(jobs: Sequence[tuple[Any, tuple[Any, ...]]], workers: int = PRECOMPILE_WORKERS) -> None:
    """Compile, build and load every recorded ``(launcher, arguments)`` job on ``workers`` threads.

    ``launcher`` has ``warmup(arguments)`` (:class:`~worldfoundry.core.fusion.launch.KernelLauncher`) and
    ``fn`` (its ``JITFunction``). Longest kernel sources first. Without ``AsyncCompileMode`` (Triton < 3.4)
    nothing is done; a failure is logged as a warning and the kernels compile on first use.
    """
    wait_warm()
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # pragma: no cover - Triton < 3.4
        return
    ordered = sorted(jobs, key=_source_length, reverse=True)
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="worldfoundry-compile") as pool:
            executor = _CompileAndLoad(pool)
            with AsyncCompileMode(executor):
                for launcher, args in ordered:
                    executor.device = _device_of(args)
                    launcher.warmup(args)
    except Exception as exc:  # noqa: BLE001 - the real launch compiles again and raises a real error
        logger.warning("concurrent precompilation of fusion kernels failed (%s: %s); they compile on first use",
                       type(exc).__name__, exc)


__all__ = ["COMPILE_MODES", "PRECOMPILE_WORKERS", "compile_concurrently", "default_compile_mode",
           "set_default_compile_mode", "wait_warm", "warm_compiler"]
