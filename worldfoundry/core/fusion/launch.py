"""Low-overhead launching of the fusion kernels: the compiled kernel is looked up once, then launched directly.

A normal Triton launch (``kernel[grid](*args, **kwargs)``) runs, on every call, Triton's argument binder, its
specialization of every argument, a cache-key computation over the options and the launch-metadata hooks: tens
of microseconds of Python per launch, which dominates a DiT block whose pointwise kernels each take a few
microseconds on the GPU. A :class:`KernelLauncher` holds everything a launch plan fixes (the grid, the integer
arguments, the constexprs and the options) and keeps, per *specialization* of the remaining arguments, the
:class:`triton.compiler.CompiledKernel` Triton itself compiled for them:

* the first launch of a specialization goes through the normal path (so Triton compiles, caches and returns the
  very kernel it would run) and its result is kept;
* later launches with the same specialization call the compiled kernel's launcher directly
  (``compiled.run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook,
  exit_hook, *args)``, the call Triton 3.x makes itself at the end of ``JITFunction.run``), with the same
  arguments in the same order -- the same machine code on the same data, so results are bitwise those of the
  normal path.

What Triton specializes on, and so what a specialization key must hold: the current device, each pointer
argument's dtype (fixed by the plan) and whether its address is a multiple of 16 bytes (checked per call: a view
into a packed tensor may be misaligned and then needs, and gets, its own compiled variant), and each specialized
integer's value class (``== 1``, ``% 16 == 0``, 32/64-bit -- fixed by the plan, which holds the integers; the
runtime integers passed per call are ``do_not_specialize`` parameters whose values stay small). The stream is
torch's current stream of the current device (``torch._C._cuda_getCurrentRawStream``, as Triton's driver reads
it), so a launch inside a CUDA-graph capture on a side stream is captured like a normal launch.

The direct path is feature-detected (``CompiledKernel.run`` / ``function`` / ``packed_metadata``); where it is
missing, or raises on first use, every launcher falls back to the normal path and the log says so once. Under
Triton's interpreter (``TRITON_INTERPRET=1``) the normal path is always used.

Example::

    launcher = KernelLauncher(_adaln_kernel, grid, n_pointers=6, constexprs=kwargs)
    launcher((out, out32, a, b, table, emb), (*ints, k0, k1))
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Final

import torch

from worldfoundry.core.fusion.compile_pool import PRECOMPILE_WORKERS, compile_concurrently, wait_warm, warm_compiler
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

logger = logging.getLogger(__name__)

#: Address alignment (bytes) Triton specializes pointer arguments on (``tt.divisibility = 16``).
POINTER_ALIGNMENT: Final = 16


def _detect() -> str | None:
    """Why the direct launch path is unavailable in this Triton (``None`` when it is available)."""
    if not TRITON_AVAILABLE:
        return "triton not importable"
    try:
        from triton.compiler import CompiledKernel
    except ImportError as exc:  # pragma: no cover - every Triton 3.x has it
        return f"triton.compiler.CompiledKernel not importable ({exc})"
    for name in ("run", "launch_metadata"):
        if not hasattr(CompiledKernel, name):
            return f"triton.compiler.CompiledKernel has no {name!r}"
    try:
        from triton import knobs  # noqa: F401  (Triton >= 3.4 keeps the launch hooks there)
    except ImportError:
        return "triton.knobs not importable"
    return None


#: Why the direct path is off for the whole process (``None``: available), set at import and on a first failure.
_UNAVAILABLE: list[str | None] = [_detect()]
#: Switched by :func:`direct_launch` (benchmarks and tests compare both paths).
_ENABLED: list[bool] = [True]
_LOGGED: set[str] = set()


def _log_once(message: str, *args: Any) -> None:
    text = message % args
    if text not in _LOGGED:
        _LOGGED.add(text)
        logger.warning("%s", text)


def direct_launch_unavailable_reason() -> str | None:
    """Why launches take Triton's normal path in this process (``None`` when the direct path is used).

    Returns:
        The reason (Triton lacks the launcher API, a first direct launch raised, or it is switched off), or
        ``None``. The interpreter is not reported here: it always uses the normal path.
    """
    if _UNAVAILABLE[0] is not None:
        return _UNAVAILABLE[0]
    return None if _ENABLED[0] else "switched off (direct_launch(False))"


@contextlib.contextmanager
def direct_launch(enabled: bool) -> Iterator[None]:
    """Switch the direct path on or off inside the ``with`` block (restored afterwards).

    Args:
        enabled: ``False`` makes every launch take Triton's normal path (for comparisons).
    """
    previous = _ENABLED[0]
    _ENABLED[0] = bool(enabled)
    try:
        yield
    finally:
        _ENABLED[0] = previous


#: Per thread, ``recording``: the launches an active :func:`precompile` block records (absent: launches run).
#: Thread-local, so that another thread's launches keep running while one thread precompiles.
_LOCAL = threading.local()


@contextlib.contextmanager
def precompile(workers: int = PRECOMPILE_WORKERS, *, compile_now: bool = True
               ) -> Iterator[list[tuple[Any, tuple[Any, ...]]]]:
    """Inside the block, fusion launches only *record* their kernel and arguments; nothing runs on the device.

    On exit the recorded kernels that are not compiled yet are compiled concurrently, and each is made ready to
    launch (launcher built, binary loaded) by the thread that compiled it
    (:func:`~worldfoundry.core.fusion.compile_pool.compile_concurrently`), so that a block's first fused call
    finds every variant it needs ready instead of compiling and loading them one after another.
    Outputs the recorded calls return are uninitialised. Under Triton's interpreter, or where Triton lacks
    ``AsyncCompileMode``, nothing is compiled (the launches compile on first use as usual). A compile error is
    logged and left to the real launch to raise.

    Args:
        workers: compile threads.
        compile_now: ``False`` only records (the caller compiles the yielded jobs itself, e.g. on a background
            thread with :func:`~worldfoundry.core.fusion.compile_pool.compile_concurrently`).

    Yields:
        The recorded ``(launcher, arguments)`` pairs (for tests and reports).

    Raises:
        RuntimeError: a :func:`precompile` block is already active.
    """
    if getattr(_LOCAL, "recording", None) is not None:
        raise RuntimeError("precompile() blocks do not nest")
    jobs: list[tuple[Any, tuple[Any, ...]]] = []
    _LOCAL.recording = jobs
    try:
        yield jobs
    finally:
        _LOCAL.recording = None
    if compile_now and jobs and TRITON_AVAILABLE and not interpreter_enabled():
        compile_concurrently(jobs, workers)


def alignment_mask(pointers: Sequence[torch.Tensor]) -> int:
    """Bit ``i`` set where ``pointers[i]``'s address is a multiple of :data:`POINTER_ALIGNMENT` (Triton's rule).

    Args:
        pointers: the tensors passed as pointer arguments.

    Returns:
        The bit mask (part of the specialization key).
    """
    mask = 0
    bit = 1
    for t in pointers:
        if t.data_ptr() % POINTER_ALIGNMENT == 0:
            mask |= bit
        bit <<= 1
    return mask


class _Runtime:
    """Triton's driver entry points, bound once (the current device and stream, the launch hooks)."""

    __slots__ = ("device", "knobs", "stream")

    def __init__(self) -> None:
        wait_warm()  # a warming thread may be creating the driver
        from triton import knobs
        from triton.runtime.driver import driver

        active = driver.active
        self.device = active.get_current_device
        self.stream = active.get_current_stream
        self.knobs = knobs.runtime


_RUNTIME: list[_Runtime | None] = [None]


def _hook_active(hook: Any) -> bool:
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)  # Triton's HookChain: empty means nothing to call
    return bool(calls) if calls is not None else True


class KernelLauncher:
    """One launch plan of a ``@triton.jit`` kernel: fixed grid, integers, constexprs and options.

    Args:
        fn: the jitted kernel.
        grid: the launch grid (plain ints).
        n_pointers: how many leading arguments are tensors (passed per call).
        fixed: the integer arguments after the pointers that the plan fixes.
        constexprs: constexpr parameters by name, plus launch options (``num_warps``, ``enable_fp_fusion``).

    A call passes the pointers and the per-call runtime scalars (the parameters between ``fixed`` and the
    constexprs, which must be ``do_not_specialize``).
    """

    __slots__ = ("_compiled", "_fixed", "_fn", "_grid", "_grid3", "_kwargs", "_proven", "_tail", "interpreted",
                 "n_pointers")

    def __init__(self, fn: Any, grid: tuple[int, ...], *, n_pointers: int, fixed: tuple[Any, ...],
                 constexprs: dict[str, Any]) -> None:
        self._fn = fn
        self._grid = tuple(grid)
        self._grid3 = (self._grid + (1, 1))[:3]
        self._fixed = tuple(fixed)
        self._kwargs = dict(constexprs)
        names = list(fn.arg_names)
        params = [n for n in names if n in constexprs]
        if params != names[len(names) - len(params):]:
            raise ValueError(f"{fn}: constexpr parameters must come last in its signature")
        self._tail = tuple(constexprs[n] for n in params)
        self.n_pointers = n_pointers
        self.interpreted = interpreter_enabled()
        #: (device, alignment mask) -> (launcher, function, packed metadata, compiled kernel)
        self._compiled: dict[tuple[int, int], tuple[Any, Any, Any, Any]] = {}
        #: a direct launch of this plan succeeded (a later exception is a real error, not a missing API)
        self._proven = False

    @property
    def fn(self) -> Any:
        """The jitted kernel."""
        return self._fn

    @property
    def grid(self) -> tuple[int, ...]:
        """The launch grid."""
        return self._grid

    def variants(self) -> int:
        """Number of specializations launched directly so far (each is one compiled kernel)."""
        return len(self._compiled)

    def arguments(self, pointers: Sequence[torch.Tensor], scalars: Sequence[Any]) -> tuple[Any, ...]:
        """Every parameter's value in signature order (pointers, fixed integers, scalars, constexprs)."""
        return (*pointers, *self._fixed, *scalars, *self._tail)

    def normal(self, pointers: Sequence[torch.Tensor], scalars: Sequence[Any]) -> Any:
        """Launch through Triton's normal path; returns what it returns (the compiled kernel on CUDA)."""
        return self._fn[self._grid](*pointers, *self._fixed, *scalars, **self._kwargs)

    def warmup(self, args: tuple[Any, ...]) -> Any:
        """Compile (or find in Triton's cache) the kernel for ``args`` (:meth:`arguments`) without launching."""
        n = len(args) - len(self._tail)
        return self._fn.warmup(*args[:n], grid=self._grid, **self._kwargs)

    def __call__(self, pointers: Sequence[torch.Tensor], scalars: Sequence[Any] = ()) -> None:
        """Launch on ``pointers`` with the runtime ``scalars`` (directly once this specialization is known)."""
        recording = getattr(_LOCAL, "recording", None)
        if self.interpreted or _UNAVAILABLE[0] is not None or not _ENABLED[0] or recording is not None:
            if recording is not None:
                recording.append((self, self.arguments(pointers, scalars)))
                return
            self.normal(pointers, scalars)
            return
        runtime = _RUNTIME[0]
        if runtime is None:
            runtime = _RUNTIME[0] = _Runtime()
        device = runtime.device()
        key = (device, alignment_mask(pointers))
        entry = self._compiled.get(key)
        if entry is None:
            self._first(key, pointers, scalars)
            return
        run, function, packed, compiled = entry
        stream = runtime.stream(device)
        knobs = runtime.knobs
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        gx, gy, gz = self._grid3
        try:
            if _hook_active(enter) or _hook_active(leave):  # a profiler listens: give it what the normal path gives
                args = self.arguments(pointers, scalars)
                run(gx, gy, gz, stream, function, packed, compiled.launch_metadata(self._grid, stream, *args),
                    enter, leave, *args)
                return
            run(gx, gy, gz, stream, function, packed, None, None, None, *pointers, *self._fixed, *scalars,
                *self._tail)
        except Exception as exc:  # noqa: BLE001 - the launcher rejects its arguments before launching anything
            if self._proven:
                raise
            _UNAVAILABLE[0] = f"a direct launch raised ({type(exc).__name__}: {exc})"
            _log_once("fusion kernels use Triton's normal launch path: %s", _UNAVAILABLE[0])
            self.normal(pointers, scalars)
            return
        self._proven = True

    def _first(self, key: tuple[int, int], pointers: Sequence[torch.Tensor], scalars: Sequence[Any]) -> None:
        """First launch of a specialization: the normal path, keeping the compiled kernel it returns."""
        wait_warm()
        compiled = self.normal(pointers, scalars)
        try:
            run = compiled.run  # initialises the handles (function) where the normal path has not
            entry = (run, compiled.function, compiled.packed_metadata, compiled)
            if entry[1] is None:
                raise RuntimeError("compiled kernel has no loaded function")
        except Exception as exc:  # noqa: BLE001 - any failure means: stay on the normal path
            _UNAVAILABLE[0] = f"the compiled kernel's launcher is unusable ({type(exc).__name__}: {exc})"
            _log_once("fusion kernels use Triton's normal launch path: %s", _UNAVAILABLE[0])
            return
        self._compiled[key] = entry


def launch_path() -> str:
    """``"interpreter"``, ``"direct"`` or ``"normal"``: how a fusion kernel launched now would be launched."""
    if interpreter_enabled():
        return "interpreter"
    return "direct" if direct_launch_unavailable_reason() is None else "normal"


if _UNAVAILABLE[0] is not None and TRITON_AVAILABLE and not interpreter_enabled():  # pragma: no cover
    _log_once("fusion kernels use Triton's normal launch path: %s", _UNAVAILABLE[0])

__all__ = [
    "POINTER_ALIGNMENT",
    "PRECOMPILE_WORKERS",
    "KernelLauncher",
    "alignment_mask",
    "direct_launch",
    "direct_launch_unavailable_reason",
    "launch_path",
    "precompile",
    "warm_compiler",
]
