"""SHA256 digests of parameters, cached per parameter version (never recomputed for an unchanged tensor).

A digest covers the dtype, the shape and the raw bytes of a tensor (device independent)::

    sha256(f"{dtype}|{list(shape)}\\n".encode() + bytes)

:func:`parameter_digest` keys its cache on the tensor object (by identity, held weakly), its version counter
(``tensor._version``, bumped by every in-place edit), its data pointer, dtype and shape: an artifact bound to a
model is verified against the weights it will replace with one hash per parameter *version*, so installing
again, or once per request, costs a dictionary lookup.

Example:
    >>> import torch
    >>> w = torch.zeros(2, 3)
    >>> parameter_digest(w) == tensor_sha256(w)
    True
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import torch

#: Threads hashing several large parameters at once (hashlib releases the GIL on large buffers).
HASH_WORKERS: Final = 8
_LOCK = threading.Lock()
_CACHE: dict[int, tuple[weakref.ref, tuple[object, ...], str]] = {}
_STATS = {"computed": 0}


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA256 of ``dtype|shape`` and the bytes of ``tensor`` (copied to the CPU, contiguous)."""
    t = tensor.detach()
    digest = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
    host = t.to("cpu").contiguous().reshape(-1)
    if host.numel():
        digest.update(memoryview(host.view(torch.uint8).numpy()))
    return digest.hexdigest()


def _key(tensor: torch.Tensor) -> tuple[object, ...]:
    return (tensor._version, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), str(tensor.device))


def parameter_digest(tensor: torch.Tensor) -> str:
    """:func:`tensor_sha256`, cached per (tensor identity, version, data pointer, dtype, shape, device)."""
    ident = id(tensor)
    try:
        key = _key(tensor)
    except RuntimeError:  # inference tensors have no version counter: never cached
        return tensor_sha256(tensor)
    with _LOCK:
        entry = _CACHE.get(ident)
        if entry is not None and entry[0]() is tensor and entry[1] == key:
            return entry[2]
    value = tensor_sha256(tensor)
    with _LOCK:
        _STATS["computed"] += 1
        _CACHE[ident] = (weakref.ref(tensor, lambda _ref, ident=ident: _forget(ident, _ref)), key, value)
    return value


def _forget(ident: int, ref: weakref.ref) -> None:
    with _LOCK:
        entry = _CACHE.get(ident)
        if entry is not None and entry[0] is ref:
            del _CACHE[ident]


def parameter_digests(tensors: Sequence[torch.Tensor]) -> list[str]:
    """:func:`parameter_digest` of each tensor, hashed by up to :data:`HASH_WORKERS` threads."""
    if len(tensors) <= 1:
        return [parameter_digest(t) for t in tensors]
    with ThreadPoolExecutor(max_workers=min(HASH_WORKERS, len(tensors))) as pool:
        return list(pool.map(parameter_digest, tensors))


def digest_computations() -> int:
    """How many digests were computed (not served from the cache) in this process."""
    with _LOCK:
        return _STATS["computed"]


__all__ = ["HASH_WORKERS", "digest_computations", "parameter_digest", "parameter_digests", "tensor_sha256"]
