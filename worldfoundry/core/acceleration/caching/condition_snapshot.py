"""``ConditionSnapshot``: detects a change of a model call's conditioning between two steps.

A cached transformation is only valid for the conditioning it was computed with. The snapshot records, for
every tensor found in the conditioning arguments (walking mappings, lists and tuples), a weak reference to
the tensor object, its version counter and its shape/dtype/device; scalars are recorded by value. A later
call matches only when the same tensor objects come back unmodified: an in-place edit bumps the version
counter, a replaced tensor fails the identity check.

Inference tensors (created under ``torch.inference_mode``) have no version counter; for them the snapshot
keeps a private copy and compares contents exactly (one read of the tensor per check).

Conditions must be built from tensors, mappings, lists/tuples and scalars (``None``, ``bool``, numbers,
``str``, ``bytes``); anything else raises :class:`~worldfoundry.errors.InvalidRequestError`.

Example:
    >>> import torch
    >>> text = torch.zeros(1, 4, 8)
    >>> snap = ConditionSnapshot.capture({"encoder_hidden_states": text})
    >>> snap.difference({"encoder_hidden_states": text}) is None
    True
    >>> _ = text.add_(1.0)
    >>> snap.difference({"encoder_hidden_states": text})
    'encoder_hidden_states: modified in place'
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from worldfoundry.errors import InvalidRequestError

_SCALARS = (bool, str, bytes, numbers.Number)


@dataclass(frozen=True)
class _TensorRecord:
    ref: weakref.ReferenceType[torch.Tensor]
    version: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    copy: torch.Tensor | None


def _unsupported(value: Any, path: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"conditioning argument {path!r} is a {type(value).__module__}.{type(value).__qualname__}; conditions must "
        "be tensors, mappings, lists/tuples and scalars"
    )


def _version_of(t: torch.Tensor) -> int | None:
    if t.is_inference():
        return None
    return int(t._version)


def _capture(value: Any, path: str) -> Any:
    if isinstance(value, torch.Tensor):
        version = _version_of(value)
        copy = value.detach().clone() if version is None else None
        return _TensorRecord(weakref.ref(value), version, tuple(value.shape), value.dtype, value.device, copy)
    if isinstance(value, Mapping):
        return ("map", tuple((str(k), _capture(v, f"{path}.{k}")) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return ("seq", type(value).__name__, tuple(_capture(v, f"{path}[{i}]") for i, v in enumerate(value)))
    if value is None or isinstance(value, _SCALARS):
        return ("scalar", value)
    raise _unsupported(value, path)


def _compare(record: Any, value: Any, path: str) -> str | None:
    if isinstance(record, _TensorRecord):
        if not isinstance(value, torch.Tensor):
            return f"{path}: a tensor was replaced by {type(value).__name__}"
        if record.ref() is not value:
            return f"{path}: a different tensor object"
        if (tuple(value.shape), value.dtype, value.device) != (record.shape, record.dtype, record.device):
            return f"{path}: shape/dtype/device changed"
        if record.version is not None:
            if _version_of(value) != record.version:
                return f"{path}: modified in place"
        elif record.copy is not None and not torch.equal(record.copy, value):
            return f"{path}: modified in place"
        return None
    kind = record[0]
    if kind == "scalar":
        if isinstance(value, torch.Tensor) or isinstance(value, Mapping | list | tuple):
            return f"{path}: changed type"
        if type(value) is not type(record[1]) or value != record[1]:
            return f"{path}: value changed"
        return None
    if kind == "map":
        if not isinstance(value, Mapping):
            return f"{path}: changed type"
        keys = tuple(str(k) for k in value)
        if keys != tuple(k for k, _ in record[1]):
            return f"{path}: keys changed"
        for (key, child), item in zip(record[1], value.values(), strict=True):
            diff = _compare(child, item, f"{path}.{key}")
            if diff is not None:
                return diff
        return None
    # sequence
    if type(value).__name__ != record[1] or not isinstance(value, list | tuple) or len(value) != len(record[2]):
        return f"{path}: changed type or length"
    for i, (child, item) in enumerate(zip(record[2], value, strict=True)):
        diff = _compare(child, item, f"{path}[{i}]")
        if diff is not None:
            return diff
    return None


class ConditionSnapshot:
    """What the conditioning of one model call looked like. Build with :meth:`capture`."""

    __slots__ = ("_records",)

    def __init__(self, records: tuple[tuple[str, Any], ...]) -> None:
        self._records = records

    @classmethod
    def capture(cls, conditions: Mapping[str, Any]) -> ConditionSnapshot:
        """Record ``conditions`` (argument name -> value).

        Raises:
            InvalidRequestError: a value is not a tensor, mapping, list/tuple or scalar (the message names it).
        """
        return cls(tuple((str(name), _capture(value, str(name))) for name, value in conditions.items()))

    @staticmethod
    def validate(conditions: Mapping[str, Any]) -> None:
        """Check the types of ``conditions`` without keeping anything (same errors as :meth:`capture`)."""
        for name, value in conditions.items():
            _validate(value, str(name))

    def difference(self, conditions: Mapping[str, Any]) -> str | None:
        """``None`` when ``conditions`` match the snapshot, else a short description of the first change."""
        names = tuple(str(n) for n in conditions)
        if names != tuple(n for n, _ in self._records):
            return f"arguments changed ({', '.join(names)})"
        for (name, record), value in zip(self._records, conditions.values(), strict=True):
            diff = _compare(record, value, name)
            if diff is not None:
                return diff
        return None

    def tensors(self) -> list[torch.Tensor]:
        """The private copies held for inference tensors (for diagnostics and release checks)."""
        found: list[torch.Tensor] = []

        def walk(record: Any) -> None:
            if isinstance(record, _TensorRecord):
                if record.copy is not None:
                    found.append(record.copy)
            elif record[0] == "map":
                for _, child in record[1]:
                    walk(child)
            elif record[0] == "seq":
                for child in record[2]:
                    walk(child)

        for _, record in self._records:
            walk(record)
        return found


def _validate(value: Any, path: str) -> None:
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, _SCALARS):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            _validate(v, f"{path}.{k}")
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _validate(v, f"{path}[{i}]")
        return
    raise _unsupported(value, path)


__all__ = ["ConditionSnapshot"]
