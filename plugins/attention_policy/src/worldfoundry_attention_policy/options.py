"""Frozen, validated options of ``attention_policy``.

Spec::

    {"attention_policy": {
        "self":        {"backend": "fa3", "min_tokens": 8192, "dense_first_steps": 0, "dense_last_steps": 0},
        "text_cross":  "sdpa",                      # a string is short for {"backend": ...}
        "image_cross": {"backend": "sdpa_cudnn"},
        "on_unavailable": "error"}}                 # or "fallback"

``cross`` sets ``text_cross`` and ``image_cross`` together (it cannot be combined with them). An attention type
that is not named, or whose backend is ``"sdpa"`` (PyTorch's own choice), is left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from worldfoundry.core.acceleration.options import (
    OptionValueError,
    PluginOptions,
    choice,
    integer,
    nested,
    option,
    optional,
    string,
)
from worldfoundry.core.attention.builtin_providers import DEFAULT_PROVIDER
from worldfoundry.core.attention.provider_dispatch import ATTENTION_TYPES, IMAGE_CROSS, SELF, TEXT_CROSS
from worldfoundry.errors import AccelerationOptionsError

PLUGIN_NAME: Final = "attention_policy"
ON_UNAVAILABLE: Final = ("error", "fallback")
_STEP_LIMIT: Final = 100_000
_TOKEN_LIMIT: Final = 2**31 - 1
#: spec key -> field name.
_TYPE_FIELDS: Final[dict[str, str]] = {SELF: "self_attention", TEXT_CROSS: "text_cross", IMAGE_CROSS: "image_cross"}


def _identifier(value: Any, path: str) -> str:
    value = string(max_length=128)(value, path)
    if not value.replace("_", "").replace("-", "").isalnum():
        raise OptionValueError(path, f"expected a provider name (letters, digits, '_', '-'), got {value!r}")
    return value


@dataclass(frozen=True)
class TypePolicy(PluginOptions):
    """What one attention type runs on.

    Attributes:
        backend: attention provider name (``"sdpa"`` = PyTorch's choice, i.e. unchanged).
        min_tokens: calls whose query or key sequence is shorter than this run PyTorch SDPA.
        dense_first_steps / dense_last_steps: denoising steps at the start / end of each request that run
            PyTorch SDPA (for approximate providers).
    """

    plugin_name: ClassVar[str] = PLUGIN_NAME
    backend: str = option(DEFAULT_PROVIDER, _identifier)
    min_tokens: int = option(0, integer(min=0, max=_TOKEN_LIMIT))
    dense_first_steps: int = option(0, integer(min=0, max=_STEP_LIMIT))
    dense_last_steps: int = option(0, integer(min=0, max=_STEP_LIMIT))

    @property
    def routed(self) -> bool:
        return self.backend != DEFAULT_PROVIDER


@dataclass(frozen=True)
class Options(PluginOptions):
    """Options of ``attention_policy`` (build with :meth:`from_mapping`; spec keys in the module docstring).

    Attributes:
        self_attention, text_cross, image_cross: the policy per attention type (``None`` = untouched).
        on_unavailable: ``"error"`` refuses the install when a provider's probe fails; ``"fallback"`` installs
            and runs PyTorch SDPA for that type, counted in the receipts with the probe's reason.
        cross_shorthand: the spec used ``cross`` (a type the model lacks is then skipped instead of refused).
    """

    plugin_name: ClassVar[str] = PLUGIN_NAME
    self_attention: TypePolicy | None = option(None, optional(nested(TypePolicy)))
    text_cross: TypePolicy | None = option(None, optional(nested(TypePolicy)))
    image_cross: TypePolicy | None = option(None, optional(nested(TypePolicy)))
    on_unavailable: str = option("error", choice(*ON_UNAVAILABLE))
    cross_shorthand: bool = False

    def validate(self) -> None:
        if not any(p is not None and p.routed for p in self.policies().values()):
            raise OptionValueError(
                "self", f"nothing selected: name a backend other than {DEFAULT_PROVIDER!r} for at least one of "
                f"{list(ATTENTION_TYPES)}")

    def policies(self) -> dict[str, TypePolicy | None]:
        """Attention type -> its policy (``None`` when not named)."""
        return {kind: getattr(self, field_name) for kind, field_name in _TYPE_FIELDS.items()}

    def routed(self) -> dict[str, TypePolicy]:
        """Attention types whose calls go to a provider other than ``sdpa``."""
        return {kind: p for kind, p in self.policies().items() if p is not None and p.routed}

    @classmethod
    def known_options(cls) -> tuple[str, ...]:
        return (*ATTENTION_TYPES, "cross", "on_unavailable")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None, *, path: str = "") -> Options:
        """Build from the spec mapping.

        Raises:
            AccelerationOptionsError: not a mapping, unknown keys, ``cross`` together with ``text_cross`` /
                ``image_cross``, a bad value (``.path`` names it), or nothing selected.
        """
        where = path or "options"
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"{where}: expected a mapping of options, got {type(options).__name__}", path=where)
        unknown = sorted(repr(k) if not isinstance(k, str) else k for k in options if k not in cls.known_options())
        if unknown:
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"{where}: unknown option(s) {unknown}; known options: {list(cls.known_options())}",
                path=where)
        if "cross" in options and (TEXT_CROSS in options or IMAGE_CROSS in options):
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"{where}.cross: give either 'cross' or 'text_cross'/'image_cross', not both",
                path=f"{where}.cross")
        prefix = f"{path}." if path else ""
        values: dict[str, Any] = {}
        for key in (*ATTENTION_TYPES, "cross"):
            if options.get(key) is None:
                continue
            policy = _type_policy(options[key], f"{prefix}{key}")
            targets = (TEXT_CROSS, IMAGE_CROSS) if key == "cross" else (key,)
            for target in targets:
                values[_TYPE_FIELDS[target]] = policy
        if "on_unavailable" in options:
            values["on_unavailable"] = options["on_unavailable"]
        values["cross_shorthand"] = "cross" in options
        return cls.build(values, path=path)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {kind: (p.to_json() if p is not None else None) for kind, p in self.policies().items()}
        out["on_unavailable"] = self.on_unavailable
        return out


def _type_policy(value: Any, path: str) -> TypePolicy:
    if isinstance(value, str):
        value = {"backend": value}
    return TypePolicy.from_mapping(value, path=path)  # type: ignore[return-value]


__all__ = ["ON_UNAVAILABLE", "PLUGIN_NAME", "Options", "TypePolicy"]
