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
from typing import Any, ClassVar, Final

from worldfoundry.core.attention.sdpa_backends import SDPA_BACKENDS
from worldfoundry.plugin import OptionValueError, PluginOptions, boolean, choice, join_path, option, string

PLUGIN_NAME: Final = "optimized_mha"

#: Allowed ``fusion`` values per attention kind; the first is the default.
FUSIONS: Final[dict[str, tuple[str, ...]]] = {"self": ("qkv", "none"), "cross": ("kv", "none")}
_KIND_KEYS: Final = ("fusion", "sdpa_backend")


@dataclass(frozen=True)
class AttentionOptions(PluginOptions):
    """What to do with one attention kind.

    Attributes:
        kind: ``"self"`` or ``"cross"``.
        fusion: ``"qkv"`` (self) / ``"kv"`` (cross) packs the projections into one storage; ``"none"`` keeps them.
        sdpa_backend: ``"torch"`` (PyTorch chooses; exact) or one of ``"flash"``, ``"cudnn"``, ``"efficient"``,
            ``"math"`` (exactly that backend; changes rounding).
    """

    plugin_name: ClassVar[str] = PLUGIN_NAME
    error_format: ClassVar[str] = "{path} must be {expected}, got {value}"

    kind: str = option(check=choice(*FUSIONS, expected="'self' or 'cross' (the attention kind)"))
    fusion: str = option(check=string(expected="a string"))
    sdpa_backend: str = option("torch", choice(*SDPA_BACKENDS))

    def validate(self) -> None:
        if self.fusion not in FUSIONS[self.kind]:
            raise OptionValueError("fusion", expected=f"one of {list(FUSIONS[self.kind])}", value=self.fusion)

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
    def for_kind(cls, kind: str, value: Any, *, path: str = "") -> AttentionOptions:
        """The settings of ``kind`` from its spec mapping (omitted fields take their defaults).

        Raises:
            AccelerationOptionsError: not a mapping, an unknown key or a bad value (named ``<kind>.<key>``).
        """
        where = join_path(path, kind)
        mapping = cls.check_mapping(value, path=where, known=_KIND_KEYS)
        return cls.build({"kind": kind, "fusion": mapping.get("fusion", FUSIONS[kind][0]),
                          "sdpa_backend": mapping.get("sdpa_backend", "torch")}, path=where)


@dataclass(frozen=True)
class Options(PluginOptions):
    """Options of ``optimized_mha``.

    Attributes:
        self_attention: settings for self-attention, ``None`` to leave it alone.
        cross_attention: settings for cross-attention, ``None`` to leave it alone.
        defaults: ``True`` when no kind was named (kinds the model lacks are then skipped instead of refused).

    Example:
        >>> Options.from_mapping({"cross": {"fusion": "none", "sdpa_backend": "cudnn"}}).to_json()
        {'self': None, 'cross': {'fusion': 'none', 'sdpa_backend': 'cudnn'}}
    """

    plugin_name: ClassVar[str] = PLUGIN_NAME
    error_format: ClassVar[str] = "{path} must be {expected}, got {value}"

    self_attention: AttentionOptions | None
    cross_attention: AttentionOptions | None
    defaults: bool = option(False, boolean())

    def validate(self) -> None:
        chosen = [k for k in (self.self_attention, self.cross_attention) if k is not None]
        if not any(k.active for k in chosen):
            raise OptionValueError(
                "", "nothing selected: every named attention kind has fusion 'none' and sdpa_backend 'torch'")

    def kinds(self) -> list[AttentionOptions]:
        return [k for k in (self.self_attention, self.cross_attention) if k is not None and k.active]

    @property
    def exact(self) -> bool:
        """Only explicit SDPA backends change rounding; fusion is exact (verified per shape at run time)."""
        return not any(k.explicit_backend for k in self.kinds())

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any], *, path: str = "") -> Options:
        """Build from the read-only mapping the installer passes to ``prepare`` (spec keys ``self``/``cross``).

        Raises:
            AccelerationOptionsError: not a mapping, unknown keys, invalid values, or nothing selected.
        """
        mapping = cls.check_mapping(options, path=path, known=tuple(FUSIONS))
        if not mapping:
            return cls.build({"self_attention": AttentionOptions("self", "qkv"),
                              "cross_attention": AttentionOptions("cross", "kv"), "defaults": True}, path=path)
        parsed = {kind: AttentionOptions.for_kind(kind, mapping[kind], path=path)
                  if mapping.get(kind) is not None else None for kind in FUSIONS}
        return cls.build({"self_attention": parsed["self"], "cross_attention": parsed["cross"]}, path=path)

    def to_json(self) -> dict[str, Any]:
        return {
            "self": self.self_attention.to_json() if self.self_attention is not None else None,
            "cross": self.cross_attention.to_json() if self.cross_attention is not None else None,
        }
