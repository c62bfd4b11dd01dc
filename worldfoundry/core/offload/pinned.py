"""Page-locked host buffers of the size asked for.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every
allocation up to the next power of two: a 1.29 GB MiniMax-H3 block would lock 2 GB, and 50 of them would
not fit in host memory. :class:`PinnedBuffer` instead allocates ordinary host memory and page-locks exactly
the pages it needs with ``cudaHostRegister``; the registration is undone by :meth:`PinnedBuffer.release`
(or when the buffer is garbage collected). Copies from registered memory are true asynchronous DMA
transfers, like copies from ``pin_memory=True`` tensors.

When registration is not possible the buffer falls back to the caching host allocator (logged, and visible
as :attr:`PinnedBuffer.method`).
"""

from __future__ import annotations

import logging
import mmap
import weakref
from typing import Final

import torch

logger = logging.getLogger(__name__)

PAGE_BYTES: Final = mmap.PAGESIZE
#: ``cudaHostRegisterPortable``: the pages count as pinned for every CUDA context of the process.
_REGISTER_PORTABLE: Final = 1


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
