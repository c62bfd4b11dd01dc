"""Page-locked host buffers of the size asked for.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every
allocation up to the next power of two: a 1.29 GB MiniMax-H3 block would lock 2 GB, and 50 of them would
not fit in host memory. :class:`PinnedBuffer` instead allocates ordinary host memory and page-locks exactly
the pages it needs with ``cudaHostRegister``; the registration is undone by :meth:`PinnedBuffer.release`
(or when the buffer is garbage collected). Copies from registered memory are true asynchronous DMA
transfers, like copies from ``pin_memory=True`` tensors.

When registration is not possible the buffer falls back to the caching host allocator (logged, and visible
as :attr:`PinnedBuffer.method`).

``Tensor.is_pinned()`` asks the caching host allocator in recent PyTorch releases and so does not see memory
registered with ``cudaHostRegister``. :func:`is_page_locked` answers for both: the caching allocator, then
CUDA itself (``cudaPointerGetAttributes`` of the loaded CUDA runtime), then this module's own record of the
ranges it registered.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import threading
import weakref
from typing import Final

import torch

logger = logging.getLogger(__name__)

PAGE_BYTES: Final = mmap.PAGESIZE
#: ``cudaHostRegisterPortable``: the pages count as pinned for every CUDA context of the process.
_REGISTER_PORTABLE: Final = 1
#: ``cudaMemoryTypeHost`` in ``cudaPointerAttributes.type`` (CUDA 11 and newer).
_CUDA_MEMORY_TYPE_HOST: Final = 1

#: ``[start, end)`` host ranges registered by live :class:`PinnedBuffer` objects, keyed by start address.
_registered: dict[int, int] = {}
_registered_lock = threading.Lock()


class _CudaPointerAttributes(ctypes.Structure):
    # the four documented fields, then room for any reserved fields a newer CUDA appends (it writes only its
    # own sizeof; a larger buffer is harmless, a smaller one would be overrun)
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p),
                ("_reserved", ctypes.c_long * 32)]


@functools.lru_cache(maxsize=1)
def _cudart_library() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (found in ``/proc/self/maps``), or ``None``."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
            library.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(_CudaPointerAttributes), ctypes.c_void_p]
            library.cudaPointerGetAttributes.restype = ctypes.c_int
            return library
        except (OSError, AttributeError):
            continue
    return None


def cuda_reports_page_locked(ptr: int) -> bool | None:
    """What ``cudaPointerGetAttributes`` says about a host address: ``True`` when CUDA knows it as page-locked
    host memory, ``False`` when not, ``None`` when the CUDA runtime cannot be asked here."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    library = _cudart_library()
    if library is None:
        return None
    attributes = _CudaPointerAttributes()
    if library.cudaPointerGetAttributes(ctypes.byref(attributes), ctypes.c_void_p(ptr)) != 0:
        _clear_cuda_error(torch.device("cuda"))
        return False
    return attributes.type == _CUDA_MEMORY_TYPE_HOST


def registered_by_this_process(ptr: int, nbytes: int) -> bool:
    """Whether ``[ptr, ptr + nbytes)`` lies inside a range a live :class:`PinnedBuffer` registered."""
    with _registered_lock:
        return any(start <= ptr and ptr + nbytes <= end for start, end in _registered.items())


def is_page_locked(tensor: torch.Tensor) -> bool:
    """Whether a CPU tensor's memory is page-locked, by either pinning method.

    Args:
        tensor: a CPU tensor.

    Returns:
        ``True`` for caching-allocator pinned memory (``Tensor.is_pinned()``) and for memory registered with
        ``cudaHostRegister`` (asked of CUDA where its runtime can be reached, else this module's record).
    """
    if tensor.device.type != "cpu":
        return False
    if tensor.is_pinned():
        return True
    ptr = tensor.data_ptr()
    answer = cuda_reports_page_locked(ptr)
    if answer is not None:
        return answer
    return registered_by_this_process(ptr, tensor.numel() * tensor.element_size())


def _cuda_call_ok(result: object) -> bool:
    code = getattr(result, "value", result)
    try:
        return int(code) == 0  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False


def _clear_cuda_error(device: torch.device) -> None:
    """A failed runtime call leaves its error as CUDA's "last error", which the next kernel launch check
    would report; one tiny launch consumes it."""
    try:
        torch.zeros(1, device=device).add_(1)
    except Exception:  # the launch check reports (and thereby clears) the stale error
        pass


def _unregister(ptr: int, device: torch.device) -> None:
    with _registered_lock:
        _registered.pop(ptr, None)
    try:
        torch.cuda.synchronize(device)  # no copy may still read the pages
        if not _cuda_call_ok(torch.cuda.cudart().cudaHostUnregister(ptr)):
            logger.warning("cudaHostUnregister failed for a pinned offload buffer")
            _clear_cuda_error(device)
    except RuntimeError as exc:  # the CUDA context may already be gone at interpreter exit
        logger.debug("cudaHostUnregister skipped: %s", exc)


class PinnedBuffer:
    """``nbytes`` of page-locked host memory as a 1-D ``uint8`` tensor (:attr:`tensor`).

    Args:
        nbytes: size in bytes.
        device: the CUDA device the buffer is copied to (for synchronisation at release).
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = int(nbytes)
        self.device = torch.device(device)
        self.method = "cuda_host_register"
        span = max(PAGE_BYTES, -(-self.nbytes // PAGE_BYTES) * PAGE_BYTES)
        raw = torch.empty(span + PAGE_BYTES, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE_BYTES
        region = raw.narrow(0, start, span)  # whole pages inside this allocation only
        ok = False
        try:
            ok = _cuda_call_ok(torch.cuda.cudart().cudaHostRegister(region.data_ptr(), span, _REGISTER_PORTABLE))
        except (RuntimeError, AttributeError) as exc:
            logger.debug("cudaHostRegister unavailable: %s", exc)
        if ok:
            with _registered_lock:
                _registered[region.data_ptr()] = region.data_ptr() + span
            self.tensor = region.narrow(0, 0, self.nbytes)
            self._raw: torch.Tensor | None = raw
            self._finalizer = weakref.finalize(self, _unregister, region.data_ptr(), self.device)
        else:
            _clear_cuda_error(self.device)
            logger.warning("exact-size host registration failed; using the caching pinned allocator "
                           "(rounds %d bytes up to a power of two)", self.nbytes)
            self.method = "pin_memory"
            self.tensor = torch.empty(max(self.nbytes, 1), dtype=torch.uint8, pin_memory=True).narrow(0, 0, self.nbytes)
            self._raw = None
            self._finalizer = None

    @property
    def locked_bytes(self) -> int:
        """Host bytes page-locked for this buffer."""
        if self.method == "pin_memory":
            size = max(self.nbytes, 1)
            return 1 << (size - 1).bit_length()
        return max(PAGE_BYTES, -(-self.nbytes // PAGE_BYTES) * PAGE_BYTES)

    def release(self) -> None:
        """Unregister (after synchronising the device) and free the memory. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._raw = None


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, PinnedBuffer]:
    """A pinned host tensor of ``shape`` and ``dtype`` backed by its own :class:`PinnedBuffer`."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buffer = PinnedBuffer(nbytes, device)
    return buffer.tensor.view(dtype).view(shape), buffer
