"""Byte layout of one block's parameters inside a flat buffer (host slab, device slot or resident copy).

Every tensor of a block gets an offset in one ``uint8`` buffer. Offsets are aligned to
:data:`TENSOR_ALIGNMENT` bytes (512): 16 bytes is what vectorised copies need, and 512 is the granularity
of the CUDA caching allocator, so a weight viewed out of a slab has the same pointer alignment as a freshly
allocated parameter. Kernel heuristics that look at pointer alignment (cuBLASLt picks algorithms by it)
therefore choose what they choose for the resident model, which keeps outputs bitwise identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

#: Byte alignment of every tensor inside a block buffer (a multiple of 16).
TENSOR_ALIGNMENT: Final = 512
#: The smallest alignment accepted (vectorised host-to-device copies need 16 bytes).
MIN_ALIGNMENT: Final = 16


def align_up(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment``.

    Example:
        >>> align_up(17, 16)
        32
    """
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a block buffer.

    Attributes:
        name: the parameter name relative to the block (``"attn1.to_q.weight"``).
        dtype / shape: the tensor's dtype and shape (contiguous strides are implied).
        offset: byte offset in the buffer (a multiple of the layout's alignment).
        nbytes: payload size in bytes.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BlockLayout:
    """The tensors of one block, laid out back to back at aligned offsets.

    Build it with :meth:`from_tensors`; :meth:`view` cuts a typed, shaped tensor out of any ``uint8`` buffer
    of at least :attr:`nbytes` bytes.
    """

    entries: tuple[TensorEntry, ...]
    nbytes: int
    alignment: int

    @classmethod
    def from_tensors(cls, named: Sequence[tuple[str, torch.Tensor]], *,
                     alignment: int = TENSOR_ALIGNMENT) -> BlockLayout:
        """Lay out ``named`` tensors in order.

        Args:
            named: ``(name, tensor)`` pairs; tensors must be contiguous.
            alignment: byte alignment of every offset (a multiple of 16).

        Returns:
            The layout; :attr:`nbytes` is the padded total.

        Raises:
            ValueError: a bad alignment or a non-contiguous tensor.
        """
        if alignment < MIN_ALIGNMENT or alignment % MIN_ALIGNMENT:
            raise ValueError(f"alignment must be a positive multiple of {MIN_ALIGNMENT}, got {alignment}")
        entries = []
        offset = 0
        for name, tensor in named:
            if not tensor.is_contiguous():
                raise ValueError(f"tensor {name!r} is not contiguous; block buffers hold contiguous tensors only")
            nbytes = tensor.numel() * tensor.element_size()
            entries.append(TensorEntry(name, tensor.dtype, tuple(tensor.shape), offset, nbytes))
            offset = align_up(offset + nbytes, alignment)
        return cls(tuple(entries), offset, alignment)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data without padding."""
        return sum(e.nbytes for e in self.entries)

    def view(self, buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
        """The tensor ``entry`` as a view of ``buffer`` (a 1-D ``uint8`` tensor)."""
        raw = buffer.narrow(0, entry.offset, entry.nbytes)
        return raw.view(entry.dtype).view(entry.shape)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """All tensors of the block as views of ``buffer``, in layout order.

        Raises:
            ValueError: ``buffer`` is not a 1-D ``uint8`` tensor of at least :attr:`nbytes` bytes.
        """
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.nbytes:
            raise ValueError(
                f"block buffer must be a 1-D uint8 tensor of >= {self.nbytes} bytes, "
                f"got {buffer.dtype} {tuple(buffer.shape)}"
            )
        return [self.view(buffer, e) for e in self.entries]
