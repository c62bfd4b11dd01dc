"""Master copies of one block's weights on the host, per tensor or as one contiguous slab.

* per tensor (``contiguous=False``): one host tensor per parameter; loading the block into a device buffer
  issues one copy per tensor.
* contiguous (``contiguous=True``): one ``uint8`` slab per block holding every tensor at an aligned offset
  (see :mod:`worldfoundry.core.offload.layout`); loading issues a single copy of the whole slab.

Host memory is pinned (page-locked, exact size, see :mod:`worldfoundry.core.offload.pinned`) when the block
runs on a CUDA device, so copies are asynchronous DMA transfers. In emulated mode (CPU as host and device)
the masters are ordinary CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worldfoundry.core.offload.layout import BlockLayout
from worldfoundry.core.offload.pinned import PinnedBuffer, pinned_empty


class HostBlockStorage:
    """The host masters of one block, in the layout of :class:`BlockLayout`.

    Build with :meth:`from_tensors`; :attr:`masters` are the tensors the block's parameters point at while
    the block is not on the device.
    """

    def __init__(self, layout: BlockLayout, masters: Sequence[torch.Tensor], slab: torch.Tensor | None,
                 pinned: bool, buffers: Sequence[PinnedBuffer] = ()) -> None:
        self.layout = layout
        self.masters = list(masters)
        self.slab = slab
        self.pinned = pinned
        self._buffers = list(buffers)

    @classmethod
    def from_tensors(cls, layout: BlockLayout, tensors: Sequence[torch.Tensor], *, contiguous: bool,
                     pin: bool, device: torch.device | None = None) -> HostBlockStorage:
        """Copy ``tensors`` (in layout order, on any device) into new host masters.

        Args:
            layout: the block layout the tensors follow.
            tensors: the current weights, one per layout entry.
            contiguous: one slab per block (``True``) or one host tensor per weight (``False``).
            pin: allocate page-locked memory (needs CUDA).
            device: the CUDA device the block is copied to (default: the current one).

        Returns:
            The storage; the copies are complete when this returns.

        Raises:
            ValueError: the tensors do not match the layout.
        """
        if len(tensors) != len(layout.entries):
            raise ValueError(f"{len(tensors)} tensors for a layout of {len(layout.entries)} entries")
        for entry, tensor in zip(layout.entries, tensors):
            if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                raise ValueError(f"tensor {entry.name!r} does not match its layout entry")
        slab = None
        buffers: list[PinnedBuffer] = []
        target = torch.device(device) if device is not None else torch.device("cuda") if pin else None
        if contiguous:
            if pin:
                buffers.append(PinnedBuffer(max(layout.nbytes, 1), target))
                slab = buffers[0].tensor
            else:
                slab = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8)
            masters = layout.views(slab)
        elif pin:
            masters = []
            for entry in layout.entries:
                tensor, buffer = pinned_empty(entry.shape, entry.dtype, target)
                masters.append(tensor)
                buffers.append(buffer)
        else:
            masters = [torch.empty(entry.shape, dtype=entry.dtype) for entry in layout.entries]
        with torch.no_grad():
            for master, tensor in zip(masters, tensors):
                master.copy_(tensor.detach())
        return cls(layout, masters, slab, pin, buffers)

    @property
    def contiguous(self) -> bool:
        return self.slab is not None

    @property
    def nbytes(self) -> int:
        """Bytes one load copies (the padded slab, or the sum of the tensors)."""
        return self.layout.nbytes if self.slab is not None else self.layout.payload_bytes

    @property
    def copies_per_load(self) -> int:
        """How many copy calls one load issues."""
        return 1 if self.slab is not None else len(self.masters)

    def copy_to(self, buffer: torch.Tensor, views: Sequence[torch.Tensor] | None = None, *,
                non_blocking: bool) -> None:
        """Copy the block into ``buffer`` (a ``uint8`` device buffer of at least ``layout.nbytes`` bytes).

        Args:
            buffer: the destination slot or resident buffer.
            views: ``layout.views(buffer)`` when already built (per-tensor layout reuses them).
            non_blocking: asynchronous copy (pinned source, CUDA destination).
        """
        if self.slab is not None:
            n = self.layout.nbytes
            if n:
                buffer.narrow(0, 0, n).copy_(self.slab.narrow(0, 0, n), non_blocking=non_blocking)
            return
        targets = list(views) if views is not None else self.layout.views(buffer)
        foreach_copy = getattr(torch, "_foreach_copy_", None)
        if foreach_copy is not None and targets:
            foreach_copy(targets, self.masters, non_blocking=non_blocking)  # one call, one copy per tensor
            return
        for target, master in zip(targets, self.masters):
            target.copy_(master, non_blocking=non_blocking)

    def restore_tensors(self, device: torch.device) -> list[torch.Tensor]:
        """Fresh, independent device tensors with the masters' values (for an exact restore)."""
        out = []
        for entry, master in zip(self.layout.entries, self.masters):
            tensor = torch.empty(entry.shape, dtype=entry.dtype, device=device)
            tensor.copy_(master)
            out.append(tensor)
        return out

    @property
    def locked_bytes(self) -> int:
        """Host bytes page-locked for this block (0 when not pinned)."""
        return sum(b.locked_bytes for b in self._buffers)

    @property
    def pin_method(self) -> str | None:
        """``"cuda_host_register"`` (exact size), ``"pin_memory"`` (fallback) or ``None`` (not pinned)."""
        methods = {b.method for b in self._buffers}
        return None if not methods else methods.pop() if len(methods) == 1 else "mixed"

    def release(self) -> None:
        """Drop the masters; pinned pages are unregistered (the caller has finished every copy)."""
        self.masters = []
        self.slab = None
        for buffer in self._buffers:
            buffer.release()
        self._buffers = []
