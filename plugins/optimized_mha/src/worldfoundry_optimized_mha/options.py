"""Frozen, validated options of ``optimized_mha``.

Spec::

    {"optimized_mha": {"self":  {"fusion": "qkv", "sdpa_backend": "torch"},
                       "cross": {"fusion": "kv",  "sdpa_backend": "torch"}}}

An empty mapping (or ``True``) selects both defaults shown above; otherwise only the attention kinds named are
touched. Inside a kind, an omitted field takes its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from worldfoundry.core.attention.sdpa_backends import SDPA_BACKENDS
from worldfoundry.errors import AccelerationOptionsError

PLUGIN_NAME: Final = "optimized_mha"

#: Allowed ``fusion`` values per attention kind; the first is the default.
FUSIONS: Final[dict[str, tuple[str, ...]]] = {"self": ("qkv", "none"), "cross": ("kv", "none")}
_KIND_KEYS: Final = frozenset({"fusion", "sdpa_backend"})


@dataclass(frozen=True)
class AttentionOptions:
    """What to do with one attention kind.

    Attributes:
        kind: ``"self"`` or ``"cross"``.
        fusion: ``"qkv"`` (self) / ``"kv"`` (cross) packs the projections into one storage; ``"none"`` keeps them.
        sdpa_backend: ``"torch"`` (PyTorch chooses; exact) or one of ``"flash"``, ``"cudnn"``, ``"efficient"``,
            ``"math"`` (exactly that backend; changes rounding).
    """

    kind: str
    fusion: str
    sdpa_backend: str = "torch"

    def __post_init__(self) -> None:
        if self.kind not in FUSIONS:
            raise AccelerationOptionsError(PLUGIN_NAME, f"unknown attention kind {self.kind!r}; use 'self' or 'cross'")
        if self.fusion not in FUSIONS[self.kind]:
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"{self.kind}.fusion must be one of {list(FUSIONS[self.kind])}, got {self.fusion!r}"
            )
        if self.sdpa_backend not in SDPA_BACKENDS:
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"{self.kind}.sdpa_backend must be one of {list(SDPA_BACKENDS)}, got {self.sdpa_backend!r}"
            )

    @property
    def fuses(self) -> bool:
        return self.fusion != "none"

    @property
    def explicit_backend(self) -> bool:
        return self.sdpa_backend != "torch"

    @property
    def active(self) -> bool:
        return self.fuses or self.explicit_backend

    def to_json(self) -> dict[str, str]:
        return {"fusion": self.fusion, "sdpa_backend": self.sdpa_backend}

    @classmethod
    def from_mapping(cls, kind: str, value: Any) -> AttentionOptions:
        if not isinstance(value, Mapping):
            raise AccelerationOptionsError(PLUGIN_NAME, f"{kind!r} must be a mapping, got {type(value).__name__}")
        unknown = sorted(set(value) - _KIND_KEYS)
        if unknown:
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"unknown option(s) {unknown} in {kind!r}; known options: {sorted(_KIND_KEYS)}"
            )
        fusion = value.get("fusion", FUSIONS[kind][0])
        backend = value.get("sdpa_backend", "torch")
        for name, item in (("fusion", fusion), ("sdpa_backend", backend)):
            if not isinstance(item, str):
                raise AccelerationOptionsError(PLUGIN_NAME, f"{kind}.{name} must be a string, got {item!r}")
        return cls(kind, fusion, backend)


@dataclass(frozen=True)
class Options:
    """Options of ``optimized_mha``.

    Attributes:
        self_attention: settings for self-attention, ``None`` to leave it alone.
        cross_attention: settings for cross-attention, ``None`` to leave it alone.
        defaults: ``True`` when no kind was named (kinds the model lacks are then skipped instead of refused).
    """

    self_attention: AttentionOptions | None
    cross_attention: AttentionOptions | None
    defaults: bool = False

    def __post_init__(self) -> None:
        chosen = [k for k in (self.self_attention, self.cross_attention) if k is not None]
        if not any(k.active for k in chosen):
            raise AccelerationOptionsError(
                PLUGIN_NAME, "nothing selected: every named attention kind has fusion 'none' and sdpa_backend 'torch'"
            )

    def kinds(self) -> list[AttentionOptions]:
        return [k for k in (self.self_attention, self.cross_attention) if k is not None and k.active]

    @property
    def exact(self) -> bool:
        """Only explicit SDPA backends change rounding; fusion is exact (verified per shape at run time)."""
        return not any(k.explicit_backend for k in self.kinds())

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> Options:
        """Build from the read-only mapping the installer passes to ``prepare``.

        Raises:
            AccelerationOptionsError: not a mapping, unknown keys, invalid values, or nothing selected.
        """
        if not isinstance(options, Mapping):
            raise AccelerationOptionsError(PLUGIN_NAME, f"options must be a mapping, got {type(options).__name__}")
        unknown = sorted(set(options) - set(FUSIONS))
        if unknown:
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"unknown option(s) {unknown}; known options: {sorted(FUSIONS)}"
            )
        if not options:
            return cls(AttentionOptions("self", "qkv"), AttentionOptions("cross", "kv"), defaults=True)
        parsed = {
            kind: AttentionOptions.from_mapping(kind, options[kind]) if options.get(kind) is not None else None
            for kind in FUSIONS
        }
        return cls(parsed["self"], parsed["cross"])

    def to_json(self) -> dict[str, Any]:
        return {
            "self": self.self_attention.to_json() if self.self_attention is not None else None,
            "cross": self.cross_attention.to_json() if self.cross_attention is not None else None,
        }
