"""``RuntimePolicy``: the frozen description of where and how a model runs, and which accelerations it gets."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from worldfoundry.core.acceleration.spec import freeze_options, normalize_acceleration_spec, thaw_options
from worldfoundry.core.model_loading.runtime_options import check_declared_option, declared_runtime_options
from worldfoundry.errors import PolicyError

#: Option keys core itself reads. A policy also accepts the options the layers above declare
#: (:mod:`worldfoundry.core.model_loading.runtime_options`); unknown keys are rejected so typos never pass silently.
KNOWN_OPTION_KEYS: Final[frozenset[str]] = frozenset(
    {
        "accelerations",  # mapping name -> options mapping (or True for defaults)
        "dit_weight_dtype",  # dtype for DiT weights (fp32 modules stay fp32)
        "text_encoder_dtype",  # dtype for text encoders
        "vae_dtype",  # dtype for the video codec
        "progress",  # bool: show tqdm progress bars
    }
)

_DTYPE_ALIASES: Final[dict[str, torch.dtype]] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def known_option_keys() -> frozenset[str]:
    """Core's option keys plus those declared by the layers above (a fresh snapshot)."""
    return KNOWN_OPTION_KEYS | frozenset(declared_runtime_options())


def parse_dtype(value: Any, *, field_name: str = "dtype") -> torch.dtype:
    """Turn ``torch.float32`` / ``"bf16"`` / ``"torch.bfloat16"`` into a floating ``torch.dtype``.

    Raises:
        PolicyError: the value names no floating dtype.
    """
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise PolicyError(f"{field_name}: {value} is not a floating dtype; use one of {sorted(_DTYPE_ALIASES)}")
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[key]
    raise PolicyError(f"{field_name}: cannot interpret {value!r} as a dtype; use one of {sorted(_DTYPE_ALIASES)}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_device(value: Any) -> torch.device:
    """Parse a device string or object. Raises :class:`PolicyError` naming the bad value."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except (RuntimeError, ValueError) as exc:
            raise PolicyError(f"device: cannot interpret {value!r} ({exc}); use e.g. 'cpu', 'cuda', 'cuda:1'") from exc
    raise PolicyError(f"device: expected a string or torch.device, got {type(value).__name__}")


# The spec and its frozen options are normalised in one place (core/acceleration/spec.py); these names stay for
# the policy's own use and for existing imports.
_freeze = freeze_options
thaw = thaw_options


@dataclass(frozen=True)
class RuntimePolicy:
    """Where a model runs and which runtime options apply.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``.
        dtype: compute dtype (``torch.bfloat16`` or ``"bf16"`` etc.).
        options: runtime options; keys must be in :func:`known_option_keys`.

    Example:
        >>> policy = RuntimePolicy(device="cpu", dtype="fp32",
        ...                        options={"accelerations": {"my_kernel": {"scale": 0.5}}})
        >>> policy.accelerations
        {'my_kernel': {'scale': 0.5}}
    """

    device: Any = "cpu"
    dtype: Any = torch.float32
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", parse_device(self.device))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if not isinstance(self.options, Mapping):
            raise PolicyError(f"options: expected a mapping, got {type(self.options).__name__}")
        known = known_option_keys()
        unknown = sorted(set(self.options) - known)
        if unknown:
            raise PolicyError(f"options: unknown key(s) {unknown}; known keys: {sorted(known)}")
        opts = dict(self.options)
        if "accelerations" in opts:
            opts["accelerations"] = normalize_acceleration_spec(opts["accelerations"], where="options.accelerations")
        for key in ("dit_weight_dtype", "text_encoder_dtype", "vae_dtype"):
            if key in opts and opts[key] is not None:
                opts[key] = parse_dtype(opts[key], field_name=f"options.{key}")
        if "progress" in opts and not isinstance(opts["progress"], bool):
            raise PolicyError(f"options.progress: expected true/false, got {opts['progress']!r}")
        for key in known - KNOWN_OPTION_KEYS:
            if key in opts:
                opts[key] = check_declared_option(key, opts[key])
        object.__setattr__(self, "options", _freeze(opts))

    # ------------------------------------------------------------------ accessors
    @property
    def accelerations(self) -> dict[str, dict[str, Any]]:
        """The acceleration spec as plain ``{name: options}`` dicts (a fresh copy)."""
        return thaw(self.options.get("accelerations", {}))

    def option(self, key: str, default: Any = None) -> Any:
        known = known_option_keys()
        if key not in known:
            raise PolicyError(f"unknown option {key!r}; known keys: {sorted(known)}")
        return self.options.get(key, default)

    def replace(self, **changes: Any) -> RuntimePolicy:
        """A copy with some fields changed; ``options`` given here are merged over the current ones."""
        unknown = sorted(set(changes) - {"device", "dtype", "options"})
        if unknown:
            raise PolicyError(f"replace: unknown field(s) {unknown}; fields: device, dtype, options")
        options = thaw(self.options)
        options.update(changes.pop("options", {}))
        return RuntimePolicy(
            device=changes.pop("device", self.device), dtype=changes.pop("dtype", self.dtype), options=options
        )

    def to_json(self) -> dict[str, Any]:
        return {"device": str(self.device), "dtype": dtype_name(self.dtype), "options": thaw(self.options)}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, path_or_mapping: str | os.PathLike[str] | Mapping[str, Any]) -> RuntimePolicy:
        """Build a policy from a YAML/JSON file or a mapping (read through OmegaConf).

        The top level holds ``device``, ``dtype`` and ``options``.

        Raises:
            PolicyError: unreadable file, unknown top-level key or invalid field.
        """
        from omegaconf import OmegaConf

        from worldfoundry.core.model_loading.input_files import load_yaml_file

        try:
            if isinstance(path_or_mapping, Mapping):
                data = OmegaConf.to_container(OmegaConf.create(thaw(path_or_mapping)), resolve=True)
            else:  # a file is data: stat first, bounded read, no OmegaConf resolvers
                data = load_yaml_file(path_or_mapping, what="policy config", max_bytes=1 << 20)
        except (OSError, ValueError, TypeError) as exc:
            raise PolicyError(f"cannot read policy config {path_or_mapping!r}: {exc}") from exc
        except Exception as exc:  # OmegaConf raises its own error types for syntax problems
            raise PolicyError(f"cannot read policy config {path_or_mapping!r}: {exc}") from exc
        if not isinstance(data, dict):
            raise PolicyError(f"policy config {path_or_mapping!r}: the top level must be a mapping")
        unknown = sorted(set(data) - {"device", "dtype", "options"})
        if unknown:
            raise PolicyError(f"policy config: unknown top-level key(s) {unknown}; known: device, dtype, options")
        return cls(
            device=data.get("device", "cpu"),
            dtype=data.get("dtype", "float32"),
            options=data.get("options") or {},
        )
