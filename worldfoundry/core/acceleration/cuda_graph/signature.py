"""Call signatures of a captured forward and the static buffers its inputs are copied into.

A CUDA graph replays fixed kernels on fixed addresses. A call may replay a graph only when everything that chose
those kernels and addresses is the same: every tensor argument's shape, strides, dtype, device and pointer alignment
(cuBLASLt picks kernels by alignment; :func:`device_alignment`; tensors under :data:`SMALL_TENSOR_BYTES` aside), every non-tensor argument's value, and the process state that changes what
a forward computes (autograd, inference mode, autocast). :func:`call_signature` is that key, built in one pass over
the arguments; arguments it cannot key (an unhashable object, a tensor with overlapping memory) make the call run
eagerly, with the reason.

:class:`StaticArguments` holds the buffers a graph reads: one per tensor argument, allocated with the argument's
strides and pointer alignment, and :meth:`StaticArguments.load` copies a call's tensors into them (safe when
arguments alias each other or a previous output: every copy reads the caller's tensor, never another buffer).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worldfoundry.core.attention.fingerprints import MAX_ALIGNMENT

#: Tensors smaller than this are keyed without their pointer offset: they are read by elementwise kernels (a
#: timestep, a scale), whose results do not depend on the address, and they are often views at a new offset on
#: every step (``scheduler.timesteps[i]``).
SMALL_TENSOR_BYTES = 256
#: Alignment of PyTorch's CPU allocator.
CPU_ALIGNMENT = 64
_SCALARS = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)


class UnkeyableArgument(Exception):
    """An argument the signature cannot describe; the call runs eagerly with ``str(exc)`` as the reason."""


@dataclass(frozen=True)
class TensorSpec:
    """Everything about a tensor argument that selects kernels or addresses (not its values)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    #: ``data_ptr() % device_alignment(device)``: the offset the static buffer reproduces.
    offset: int
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor, name: str) -> TensorSpec:
        if _has_overlap(tensor):
            raise UnkeyableArgument(f"input {name} has overlapping memory (as_strided)")
        nbytes = tensor.numel() * tensor.element_size()
        offset = tensor.data_ptr() % device_alignment(tensor.device) if nbytes >= SMALL_TENSOR_BYTES else 0
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, offset,
                   tensor.requires_grad)

    @property
    def nbytes(self) -> int:
        return _storage_elements(self.shape, self.stride) * _itemsize(self.dtype)

    def describe(self) -> str:
        dims = "x".join(str(s) for s in self.shape) or "scalar"
        return f"{dims} {str(self.dtype).removeprefix('torch.')} {self.device}"


def device_alignment(device: torch.device) -> int:
    """The pointer alignment kept in signatures: what kernels may look at on CUDA (cuBLASLt: up to 256 bytes), the
    allocator's alignment elsewhere (64 bytes on the CPU, so fresh tensors always share one signature)."""
    return MAX_ALIGNMENT if device.type == "cuda" else CPU_ALIGNMENT


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _storage_elements(shape: Sequence[int], stride: Sequence[int]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))


def _dedup(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor without its broadcast (stride-0) dimensions: what an expanded tensor really stores."""
    for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride(), strict=True)):
        if stride == 0 and size > 1:
            tensor = tensor.narrow(dim, 0, 1)
    return tensor


def _has_overlap(tensor: torch.Tensor) -> bool:
    """Whether two elements of the tensor (broadcast dimensions aside) share memory."""
    dims = sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz > 1 and st != 0)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _key(value: Any, name: str, specs: list[TensorSpec], tensors: list[torch.Tensor]) -> Hashable:
    if isinstance(value, torch.Tensor):
        specs.append(TensorSpec.of(value, name))
        tensors.append(value)
        return ("T", len(specs) - 1)
    if isinstance(value, _SCALARS):
        return (type(value).__name__, value)
    if isinstance(value, tuple | list):
        return (type(value).__name__, tuple(_key(v, f"{name}[{i}]", specs, tensors) for i, v in enumerate(value)))
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise UnkeyableArgument(f"argument {name} is a mapping with non-string keys")
        return ("dict", tuple((k, _key(value[k], f"{name}.{k}", specs, tensors)) for k in sorted(value)))
    raise UnkeyableArgument(f"argument {name} of type {type(value).__name__} cannot be part of a graph signature")


def process_state() -> tuple[Any, ...]:
    """Process-wide state that changes what a forward computes: autograd, inference mode, autocast."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))


@dataclass(frozen=True)
class CallSignature:
    """The hashable key of one call (``key``) and the tensor arguments in the order the key numbers them."""

    key: Hashable
    specs: tuple[TensorSpec, ...]
    tensors: tuple[torch.Tensor, ...]

    def describe(self) -> str:
        return ", ".join(spec.describe() for spec in self.specs)


def call_signature(args: tuple[Any, ...], kwargs: Mapping[str, Any], extra: Hashable = ()) -> CallSignature:
    """Key a call.

    Args:
        args, kwargs: the forward's arguments (tensors, scalars, ``None`` and tuples/lists/str-keyed dicts of them).
        extra: more state to key by (installed plugins, their per-call keys).

    Returns:
        The :class:`CallSignature`.

    Raises:
        UnkeyableArgument: an argument the key cannot describe.
    """
    specs: list[TensorSpec] = []
    tensors: list[torch.Tensor] = []
    positional = tuple(_key(v, f"#{i}", specs, tensors) for i, v in enumerate(args))
    named = tuple((k, _key(kwargs[k], k, specs, tensors)) for k in sorted(kwargs))
    return CallSignature((positional, named, tuple(specs), process_state(), extra), tuple(specs), tuple(tensors))


def allocate_like(spec: TensorSpec, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised tensor with ``spec``'s shape, strides, dtype, device and pointer offset.

    Args:
        spec: what to reproduce.
        pin: page-lock a CPU buffer (a CUDA graph may copy from it host-to-device on every replay).
    """
    itemsize = _itemsize(spec.dtype)
    elements = _storage_elements(spec.shape, spec.stride)
    align = device_alignment(spec.device)
    flat = torch.empty(elements + align // itemsize, dtype=spec.dtype, device=spec.device,
                       pin_memory=pin and spec.device.type == "cpu")
    shift = ((spec.offset - flat.data_ptr() % align) % align) // itemsize
    return flat.as_strided(spec.shape, spec.stride, shift)


class StaticArguments:
    """Static buffers for the tensor arguments of one signature and the arguments rebuilt around them.

    Args:
        args, kwargs: the call the signature was taken from.
        signature: its :class:`CallSignature`.
        pin: page-lock CPU buffers (for a CUDA graph).
    """

    def __init__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], signature: CallSignature, *,
                 pin: bool = False) -> None:
        self.buffers = tuple(allocate_like(spec, pin=pin) for spec in signature.specs)
        iterator = iter(self.buffers)
        self.args = tuple(_rebuild(v, iterator) for v in args)
        self.kwargs = {k: _rebuild(kwargs[k], iterator) for k in sorted(kwargs)}

    @property
    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self.buffers)

    def load(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy a call's tensor arguments (same signature) into the buffers."""
        load_into(self.buffers, tensors)

    def release(self) -> None:
        self.buffers = ()
        self.args = ()
        self.kwargs = {}


def load_into(buffers: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
    """``buffer.copy_(tensor)`` for each pair (broadcast dimensions copied once); a buffer given as its own source
    is skipped."""
    dst = []
    src = []
    for buffer, tensor in zip(buffers, tensors, strict=True):
        if buffer is tensor:
            continue
        dst.append(_dedup(buffer))
        src.append(_dedup(tensor))
    if not dst:
        return
    with torch.no_grad():
        if all(d.device == s.device and d.dtype == s.dtype for d, s in zip(dst, src, strict=True)):
            torch._foreach_copy_(dst, src)
        else:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)


def _rebuild(value: Any, buffers: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return next(buffers)
    if isinstance(value, tuple | list):
        return type(value)(_rebuild(v, buffers) for v in value)
    if isinstance(value, Mapping):
        return {k: _rebuild(value[k], buffers) for k in sorted(value)}
    return value


__all__ = [
    "CallSignature",
    "StaticArguments",
    "TensorSpec",
    "UnkeyableArgument",
    "allocate_like",
    "call_signature",
    "load_into",
    "process_state",
]
