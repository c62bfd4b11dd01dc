"""Cheap, exact "has this tensor changed?" keys for derived tensors and caches.

A fingerprint holds a strong reference to the tensor it describes (so its ``id`` can never be reused while the
fingerprint lives) and compares that reference by identity, together with the version counter PyTorch bumps on
every in-place operation, the data pointer, dtype, device, shape and strides. Writes through ``tensor.data``
bypass the version counter and are therefore not seen; callers document that such edits require a reinstall.

Inference tensors (created under ``torch.inference_mode()``) have no version counter; :class:`ContentVersions`
gives them a synthetic one by comparing contents with a private snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Final

import torch

#: Largest pointer alignment that can influence kernel selection (cuBLASLt looks at up to 256 bytes).
MAX_ALIGNMENT: Final = 256


class IdentityRef:
    """Wraps an object so that equality is identity; keeps the object alive."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IdentityRef) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"IdentityRef({type(self.obj).__name__}@{id(self.obj):#x})"


def tensor_version(tensor: torch.Tensor) -> int | None:
    """``tensor._version``, or ``None`` for inference tensors (which have no version counter)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def alignment(tensor: torch.Tensor) -> int:
    """The largest power of two (capped at :data:`MAX_ALIGNMENT`) that divides the tensor's data pointer."""
    ptr = tensor.data_ptr()
    return MAX_ALIGNMENT if ptr == 0 else min(ptr & -ptr, MAX_ALIGNMENT)


def tensor_state(tensor: torch.Tensor | None, version: int | None = None) -> tuple[Any, ...]:
    """A hashable-free, comparable key of ``tensor``'s identity and layout (``()`` for ``None``).

    Args:
        tensor: the tensor (or ``None``).
        version: an explicit version to use instead of ``tensor._version`` (see :class:`ContentVersions`).

    Returns:
        ``(IdentityRef(tensor), version, data_ptr, dtype, device, shape, stride)``.
    """
    if tensor is None:
        return ()
    if version is None:
        version = tensor_version(tensor)
    return (IdentityRef(tensor), version, tensor.data_ptr(), tensor.dtype, tensor.device, tuple(tensor.shape),
            tuple(tensor.stride()))


def parameters_state(modules: Iterable[torch.nn.Module]) -> tuple[Any, ...]:
    """The :func:`tensor_state` of every parameter registered on ``modules`` (recursively), in order.

    A parameter replaced by assignment, edited in place, moved or cast changes this key.
    """
    state: list[Any] = []
    for module in modules:
        for name, param in module.named_parameters(recurse=True):
            state.append((name, tensor_state(param)))
    return tuple(state)


class ContentVersions:
    """Synthetic version counters for tensors without one (inference tensors).

    :meth:`version` returns a number that changes whenever the contents of the same tensor object change between
    two observations. It keeps a private copy of the last ``max_tracked`` tensors it saw.
    """

    def __init__(self, max_tracked: int = 8) -> None:
        self.max_tracked = max_tracked
        self._seen: OrderedDict[int, tuple[torch.Tensor, torch.Tensor, int]] = OrderedDict()
        self._counter = 0

    def version(self, tensor: torch.Tensor) -> int:
        """A version of ``tensor``: its real ``_version`` offset by the content counter when it has none.

        Args:
            tensor: any tensor.

        Returns:
            An integer that changes when the tensor's contents changed since the previous call for it.
        """
        real = tensor_version(tensor)
        if real is not None:
            return real
        key = id(tensor)
        entry = self._seen.get(key)
        if entry is not None and entry[0] is tensor:
            _, snapshot, version = entry
            if snapshot.shape == tensor.shape and torch.equal(snapshot, tensor):
                self._seen.move_to_end(key)
                return version
        self._counter += 1
        with torch.inference_mode():
            snapshot = tensor.detach().clone()
        self._seen[key] = (tensor, snapshot, -self._counter)
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_tracked:
            self._seen.popitem(last=False)
        return -self._counter

    def clear(self) -> None:
        self._seen.clear()


__all__ = [
    "MAX_ALIGNMENT",
    "ContentVersions",
    "IdentityRef",
    "alignment",
    "parameters_state",
    "tensor_state",
    "tensor_version",
]
