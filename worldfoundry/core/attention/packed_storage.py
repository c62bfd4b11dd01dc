"""Packed weights for Linears that read the same input (Q/K/V, K/V).

Two forms:

* :class:`PackedLinearParameters` — *shared storage*. The weights of the Linears are copied once into one
  contiguous ``(sum(out_features), in_features)`` tensor (biases likewise) and every original Parameter is made a
  view of its rows (``param.data = packed[a:b]``). Parameter objects, names and values stay; the old separate
  storages are freed, so no weight memory is added. :meth:`PackedLinearParameters.unpack` gives every Parameter a
  new storage of its own with the same values.
* :class:`DerivedPackedLinear` — *derived copy*. The originals are untouched; a packed copy is built and rebuilt
  whenever a source Parameter is replaced, edited in place (version counter), moved or cast. Raw writes through
  ``param.data`` are not seen (they bypass the version counter).

Both return :class:`PackedWeights` from ``current()``; :func:`check_linears_packable` says why a group cannot be
packed (typed :class:`~worldfoundry.errors.ParameterPackingError`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple

import torch
import torch.nn as nn

from worldfoundry.core.attention.fingerprints import alignment
from worldfoundry.core.attention.source_watch import linears_state
from worldfoundry.errors import ParameterPackingError

#: Parameter dtypes that can be packed and run through ``F.linear``.
PACKABLE_DTYPES: Final = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class PackedWeights(NamedTuple):
    """What a fused projection multiplies with.

    Attributes:
        weight: ``(sum(out_features), in_features)``.
        bias: ``(sum(out_features),)`` or ``None``.
        layout: pointer alignments of the packed and member tensors (part of the bitwise-verification key,
            because some GEMM libraries pick kernels by alignment).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    layout: tuple[int, ...]


def storage_owners(model: nn.Module) -> dict[int, list[str]]:
    """Map storage data pointer -> names of every parameter/buffer of ``model`` using it (duplicates kept)."""
    owners: dict[int, list[str]] = {}
    named = itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if tensor is None or tensor.numel() == 0 or tensor.device.type == "meta":
            continue
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        owners.setdefault(ptr, []).append(name)
    return owners


def _check_tensor(path: str, tensor: Any) -> None:
    if not isinstance(tensor, nn.Parameter) or type(tensor) is not nn.Parameter:
        raise ParameterPackingError(
            f"{path} is a {type(tensor).__name__}, not a plain nn.Parameter "
            "(quantized or wrapped weights cannot be packed)"
        )
    if tensor.is_quantized or tensor.dtype not in PACKABLE_DTYPES:
        raise ParameterPackingError(
            f"{path} has dtype {tensor.dtype}; only {sorted(map(str, PACKABLE_DTYPES))} can be packed"
        )
    if tensor.device.type == "meta":
        raise ParameterPackingError(f"{path} is on the meta device (weights not loaded)")
    if not tensor.is_contiguous():
        raise ParameterPackingError(f"{path} is not contiguous")


def check_linears_packable(linears: Sequence[tuple[str, nn.Module]], *,
                           owners: Mapping[int, Sequence[str]] | None = None, share_storage: bool = True) -> None:
    """Raise when the Linears cannot be packed.

    Args:
        linears: ``(module path, module)`` pairs, at least two, all reading the same input.
        owners: :func:`storage_owners` of the whole model; with ``share_storage`` it detects tied or shared
            parameters (a storage used by any other parameter or buffer).
        share_storage: check what :class:`PackedLinearParameters` needs (each weight and bias owns its whole
            storage, so re-pointing it frees the old memory); otherwise what :class:`DerivedPackedLinear` needs.

    Raises:
        ParameterPackingError: the reason, naming the parameter.
    """
    if len(linears) < 2:
        raise ParameterPackingError(f"need at least two Linears to pack, got {[p for p, _ in linears]}")
    first_path, first = linears[0]
    seen: set[int] = set()
    for path, module in linears:
        if type(module) is not nn.Linear:
            raise ParameterPackingError(f"{path} is a {type(module).__name__}, not a plain torch.nn.Linear")
        if module.in_features != first.in_features:
            raise ParameterPackingError(
                f"{path} reads {module.in_features} features but {first_path} reads {first.in_features}"
            )
        if (module.bias is None) != (first.bias is None):
            raise ParameterPackingError(f"{path} and {first_path} differ in having a bias")
        for kind in ("weight", "bias"):
            tensor = module._parameters.get(kind)
            if tensor is None:
                if kind == "weight":
                    raise ParameterPackingError(f"{path} has no weight Parameter")
                continue
            where = f"{path}.{kind}"
            _check_tensor(where, tensor)
            if tensor.dtype != first.weight.dtype or tensor.device != first.weight.device:
                raise ParameterPackingError(
                    f"{where} is {tensor.dtype} on {tensor.device} but {first_path}.weight is "
                    f"{first.weight.dtype} on {first.weight.device}; packed tensors need one dtype and device"
                )
            if id(tensor) in seen:
                raise ParameterPackingError(f"{where} is the same Parameter as another member (tied weights)")
            seen.add(id(tensor))
            if not share_storage:
                continue
            storage = tensor.untyped_storage()
            if tensor.storage_offset() != 0 or storage.nbytes() != tensor.numel() * tensor.element_size():
                raise ParameterPackingError(
                    f"{where} is a view into a larger storage; packing it would not free memory"
                )
            if owners is not None:
                names = list(owners.get(storage.data_ptr(), ()))
                if names != [where]:
                    others = [n for n in names if n != where] or names
                    raise ParameterPackingError(
                        f"{where} shares its storage with {others[:4]} (tied or shared parameters)"
                    )


def _members(linears: Sequence[nn.Linear]) -> tuple[tuple[nn.Linear, ...], tuple[int, ...]]:
    modules = tuple(linears)
    return modules, tuple(m.out_features for m in modules)


def _layout(weight: torch.Tensor, bias: torch.Tensor | None, modules: Sequence[nn.Linear]) -> tuple[int, ...]:
    parts = [alignment(weight), alignment(bias) if bias is not None else 0]
    for module in modules:
        parts.append(alignment(module.weight))
        parts.append(alignment(module.bias) if module.bias is not None else 0)
    return tuple(parts)


class PackedLinearParameters:
    """Original Parameters turned into row views of one packed weight (and one packed bias) storage.

    Create with :meth:`pack`; :meth:`current` returns the packed tensors while every member Parameter is still
    the same object viewing the same rows, and a reason string otherwise (replaced Parameter, moved/cast model).
    In-place edits of the Parameters (``load_state_dict``, ``copy_``) write into the packed storage, so the packed
    tensors stay valid without any refresh.
    """

    def __init__(self, modules: tuple[nn.Linear, ...], split_sizes: tuple[int, ...], weight: torch.Tensor,
                 bias: torch.Tensor | None, expected: tuple[tuple[Any, ...], ...]) -> None:
        self.modules = modules
        self.split_sizes = split_sizes
        self._weight: torch.Tensor | None = weight
        self._bias = bias
        self._expected = expected
        self._layout = _layout(weight, bias, modules)

    @classmethod
    def pack(cls, linears: Sequence[nn.Linear]) -> PackedLinearParameters:
        """Copy the members' weights/biases into one storage each and re-point the Parameters at it.

        The caller checks :func:`check_linears_packable` first. The copy is complete before any Parameter
        changes, so a failure leaves the members untouched.

        Returns:
            The packed group (keep it to :meth:`unpack`).
        """
        modules, splits = _members(linears)
        first = modules[0].weight
        with torch.no_grad():
            weight = torch.cat([m.weight.detach() for m in modules], dim=0).contiguous()
            bias = None
            if modules[0].bias is not None:
                bias = torch.cat([m.bias.detach() for m in modules], dim=0).contiguous()
            if weight.dtype != first.dtype:  # pragma: no cover - cat keeps the dtype
                raise ParameterPackingError("packing changed the dtype")
            offset = 0
            expected = []
            for module, size in zip(modules, splits, strict=True):
                module.weight.data = weight[offset:offset + size]
                if bias is not None:
                    module.bias.data = bias[offset:offset + size]
                offset += size
                expected.append(cls._member_key(module))
        return cls(modules, splits, weight, bias, tuple(expected))

    @staticmethod
    def _member_key(module: nn.Linear) -> tuple[Any, ...]:
        weight = module._parameters["weight"]
        bias = module._parameters.get("bias")
        return (weight, weight.data_ptr(), bias, bias.data_ptr() if bias is not None else 0)

    @property
    def weight(self) -> torch.Tensor | None:
        return self._weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias

    def current(self) -> PackedWeights | str:
        """The packed tensors, or why they no longer describe the members.

        Returns:
            :class:`PackedWeights`, or a reason string (``"unpacked"``, ``"parameter_replaced"``,
            ``"storage_changed"``).
        """
        if self._weight is None:
            return "unpacked"
        for module, (weight, weight_ptr, bias, bias_ptr) in zip(self.modules, self._expected, strict=True):
            params = module._parameters
            if params.get("weight") is not weight or params.get("bias") is not bias:
                return "parameter_replaced"
            if weight.data_ptr() != weight_ptr or (bias is not None and bias.data_ptr() != bias_ptr):
                return "storage_changed"
        return PackedWeights(self._weight, self._bias, self._layout)

    def shares_storage(self) -> bool:
        """Whether every member Parameter still views the packed storage."""
        return isinstance(self.current(), PackedWeights)

    def unpack(self) -> None:
        """Give every member Parameter still viewing the packed storage a new storage with the same values.

        Idempotent. Covers the Parameters that were packed (also if they were unregistered since) and any
        registered member Parameter still viewing the storage; Parameters re-pointed elsewhere are left alone.
        """
        if self._weight is None:
            return
        packed = {self._weight.untyped_storage().data_ptr()}
        if self._bias is not None:
            packed.add(self._bias.untyped_storage().data_ptr())
        candidates: list[torch.Tensor] = []
        for weight, _, bias, _ in self._expected:
            candidates.extend(t for t in (weight, bias) if t is not None)
        for module in self.modules:
            candidates.extend(p for p in (module._parameters.get("weight"), module._parameters.get("bias"))
                              if p is not None)
        done: set[int] = set()
        with torch.no_grad():
            for param in candidates:
                if id(param) in done:
                    continue
                done.add(id(param))
                if param.untyped_storage().data_ptr() in packed:
                    param.data = param.data.clone(memory_format=torch.contiguous_format)
        self._weight = None
        self._bias = None

    @property
    def nbytes(self) -> int:
        total = 0
        for tensor in (self._weight, self._bias):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total


class DerivedPackedLinear:
    """A packed copy of the members' weights, rebuilt when any source Parameter changes.

    Changes seen: Parameter replaced (identity), in-place edits (version counter, e.g. ``load_state_dict``,
    ``param.copy_``), dtype/device moves and re-pointed data (data pointer). Not seen: writes through
    ``param.data`` that keep the pointer (no version bump).
    """

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        self.modules, self.split_sizes = _members(linears)
        self._source: tuple[Any, ...] | None = None
        self._packed: PackedWeights | None = None
        self.builds = 0

    def source_state(self) -> tuple[Any, ...]:
        """Identity/version/pointer/dtype/device key of every source Parameter."""
        return linears_state(self.modules)

    def current(self) -> PackedWeights:
        """The packed copy, rebuilt first when a source Parameter changed.

        Raises:
            ParameterPackingError: the sources no longer share one dtype/device or bias layout.
        """
        state = self.source_state()
        if self._packed is None or state != self._source:
            self._packed = self._build()
            self._source = state
            self.builds += 1
        return self._packed

    def _build(self) -> PackedWeights:
        modules = self.modules
        weights = [m.weight for m in modules]
        biases = [m.bias for m in modules]
        if len({(w.dtype, w.device) for w in weights}) != 1:
            raise ParameterPackingError("the packed projections no longer share one dtype and device; reinstall")
        if any(b is None for b in biases) != all(b is None for b in biases):
            raise ParameterPackingError("the packed projections no longer agree on having a bias; reinstall")
        with torch.no_grad():
            weight = torch.cat([w.detach() for w in weights], dim=0).contiguous()
            bias = None if biases[0] is None else torch.cat([b.detach() for b in biases], dim=0).contiguous()
        return PackedWeights(weight, bias, _layout(weight, bias, modules))

    def release(self) -> None:
        """Drop the packed copy (rebuilt on the next :meth:`current`)."""
        self._packed = None
        self._source = None

    @property
    def nbytes(self) -> int:
        if self._packed is None:
            return 0
        total = self._packed.weight.numel() * self._packed.weight.element_size()
        if self._packed.bias is not None:
            total += self._packed.bias.numel() * self._packed.bias.element_size()
        return total


__all__ = [
    "PACKABLE_DTYPES",
    "DerivedPackedLinear",
    "PackedLinearParameters",
    "PackedWeights",
    "check_linears_packable",
    "storage_owners",
]
