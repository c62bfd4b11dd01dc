"""The acceleration spec, in one place: ``{name: options mapping | True | False | None}`` -> ``{name: dict}``.

Both the runtime policy (``RuntimePolicy(options={"accelerations": ...})``) and the installer normalise specs
here; factories receive each plugin's options frozen (read-only mappings, tuples) by :func:`freeze_options`.
On a routed denoiser a plugin's options may carry ``per_expert`` overrides (:func:`expert_options`): each expert's
factory then receives the options with its own overrides merged over them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

import torch

from worldfoundry.errors import AccelerationOptionsError, PolicyError


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


#: Options key of per-expert overrides: ``{"some_cache": {"threshold": 0.05, "per_expert": {"low": {"threshold":
#: 0.1}}}}`` -- each expert of a routed denoiser gets the options with its overrides merged over them.
PER_EXPERT: Final = "per_expert"


def check_per_expert(normalized: Mapping[str, Mapping[str, Any]], labels: Sequence[str], *,
                     where: str = "spec") -> None:
    """Refuse ``per_expert`` overrides that name no expert of the model or are not option mappings.

    Raises:
        AccelerationOptionsError: naming the JSON path of the bad entry and the model's experts.
    """
    for name, options in normalized.items():
        overrides = options.get(PER_EXPERT)
        if overrides is None:
            continue
        path = f"{where}.{name}.{PER_EXPERT}"
        if not isinstance(overrides, Mapping) or not overrides:
            raise AccelerationOptionsError(name, f"{path}: expected a non-empty mapping expert -> options",
                                           path=path)
        for label, extra in overrides.items():
            if label not in labels:
                raise AccelerationOptionsError(
                    name, f"{path}.{label}: no such expert; the model's experts are {list(labels)}",
                    path=f"{path}.{label}")
            if not isinstance(extra, Mapping) or PER_EXPERT in extra:
                raise AccelerationOptionsError(
                    name, f"{path}.{label}: expected an options mapping (without {PER_EXPERT!r})",
                    path=f"{path}.{label}")


def expert_options(options: Mapping[str, Any], label: str) -> dict[str, Any]:
    """``options`` for the expert ``label``: its ``per_expert`` overrides merged over the rest (key removed)."""
    base = {k: v for k, v in options.items() if k != PER_EXPERT}
    overrides = (options.get(PER_EXPERT) or {}).get(label) or {}
    return {**base, **thaw_options(overrides)}


__all__ = ["PER_EXPERT", "check_per_expert", "expert_options", "freeze_options", "normalize_acceleration_spec",
           "thaw_options"]
