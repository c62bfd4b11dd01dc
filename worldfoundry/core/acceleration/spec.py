"""The acceleration spec, in one place: ``{name: options mapping | True | False | None}`` -> ``{name: dict}``.

Both the runtime policy (``RuntimePolicy(options={"accelerations": ...})``) and the installer normalise specs
here; factories receive each plugin's options frozen (read-only mappings, tuples) by :func:`freeze_options`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from worldfoundry.errors import PolicyError

def freeze_options(value: Any) -> Any:
    """A read-only copy: mappings become ``MappingProxyType`` with string keys, lists/tuples become tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): freeze_options(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze_options(v) for v in value)
    return value


def thaw_options(value: Any) -> Any:
    """Plain ``dict``/``list`` copies of a frozen options structure (for JSON and for plugins); dtypes by name."""
    if isinstance(value, Mapping):
        return {k: thaw_options(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw_options(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


def normalize_acceleration_spec(spec: Any, *, where: str = "accelerations") -> dict[str, dict[str, Any]]:
    """Validate an accelerations mapping and return ``{name: options dict}``.

    ``True`` means "defaults" (empty options); ``False``/``None`` drop the entry.

    Args:
        spec: the mapping (or ``None``).
        where: the input's name in error messages.

    Returns:
        ``{name: plain options dict}`` in the spec's order.

    Raises:
        PolicyError: the spec is not a mapping of names to mappings / booleans.
    """
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise PolicyError(f"{where}: expected a mapping name -> options, got {type(spec).__name__}")
    out: dict[str, dict[str, Any]] = {}
    for name, opts in spec.items():
        if not isinstance(name, str) or not name:
            raise PolicyError(f"{where}: acceleration names must be non-empty strings, got {name!r}")
        if opts is True:
            out[name] = {}
        elif opts is False or opts is None:
            continue
        elif isinstance(opts, Mapping):
            out[name] = thaw_options(opts)
        else:
            raise PolicyError(
                f"{where}.{name}: expected an options mapping or true, got {type(opts).__name__} ({opts!r})"
            )
    return out


__all__ = ["freeze_options", "normalize_acceleration_spec", "thaw_options"]
