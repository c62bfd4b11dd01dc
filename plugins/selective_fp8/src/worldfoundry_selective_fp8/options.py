"""``selective_fp8`` options: a frozen, validated dataclass built from the spec mapping."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

from worldfoundry.errors import AccelerationOptionsError

PLUGIN_NAME: Final = "selective_fp8"
SCALINGS: Final = ("rowwise",)


def _patterns(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise AccelerationOptionsError(
            PLUGIN_NAME, f"{name}: expected a list of module-name patterns, got {value!r}"
            + (f"; write [{value!r}]" if isinstance(value, str) else "")
        )
    out = []
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise AccelerationOptionsError(PLUGIN_NAME, f"{name}: patterns must be non-empty strings, got {item!r}")
        out.append(item.strip())
    return tuple(out)


@dataclass(frozen=True)
class Options:
    """Selective FP8 options.

    Args:
        include: fnmatch patterns on ``model.named_modules()`` names selecting the Linears to run in FP8
            (``*`` also matches dots). ``None`` selects the family's FFN Linears (Wan:
            ``blocks.*.ffn.net.0.proj`` and ``blocks.*.ffn.net.2``; MiniMax-H3:
            ``transformer_blocks.*.ff.net.0.proj`` and ``transformer_blocks.*.ff.net.2``); SANA-Video has no
            Linear FFN, so it needs an explicit list.
        exclude: patterns removed from the selection.
        scaling: ``"rowwise"`` (one scale per weight row and per activation row) is the only scaling.
        use_fast_accum: ``torch._scaled_mm(use_fast_accum=...)``; faster, less accurate accumulation.
        min_tokens: inputs with fewer rows (tokens) than this run the dense Linear (small GEMMs gain nothing
            from FP8); the receipt records each such call.
        fuse_gelu: when both Linears of a diffusers ``FeedForward`` with a GELU activation are selected, run
            the GELU and the down projection's activation quantization as one Triton kernel (the FFN's forward
            is replaced; same activation as the dense GELU). ``False`` keeps the strict per-Linear path.

    Raises:
        AccelerationOptionsError: wrong type, unknown scaling or negative ``min_tokens``.

    Example:
        >>> Options.from_mapping({"include": ["blocks.*.ffn.net.2"], "min_tokens": 256})
        Options(include=('blocks.*.ffn.net.2',), exclude=(), scaling='rowwise', use_fast_accum=False, min_tokens=256, fuse_gelu=True)
    """

    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    scaling: str = "rowwise"
    use_fast_accum: bool = False
    min_tokens: int = 1024
    fuse_gelu: bool = True

    def __post_init__(self) -> None:
        if self.include is not None:
            include = _patterns("include", self.include)
            if not include:
                raise AccelerationOptionsError(PLUGIN_NAME, "include: give at least one pattern (or leave it out)")
            object.__setattr__(self, "include", include)
        object.__setattr__(self, "exclude", _patterns("exclude", self.exclude))
        if self.scaling not in SCALINGS:
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"scaling: only {list(SCALINGS)} is supported, got {self.scaling!r}"
            )
        if not isinstance(self.use_fast_accum, bool):
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"use_fast_accum: expected true/false, got {self.use_fast_accum!r}"
            )
        if not isinstance(self.fuse_gelu, bool):
            raise AccelerationOptionsError(PLUGIN_NAME, f"fuse_gelu: expected true/false, got {self.fuse_gelu!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"min_tokens: expected an integer >= 0, got {self.min_tokens!r}"
            )

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> Options:
        """Build from the spec mapping; unknown keys are rejected by name.

        Raises:
            AccelerationOptionsError: unknown key, wrong type or invalid value.
        """
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise AccelerationOptionsError(PLUGIN_NAME, f"options: expected a mapping, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise AccelerationOptionsError(PLUGIN_NAME, f"unknown option(s) {unknown}; known options: {sorted(known)}")
        return cls(**{str(k): v for k, v in options.items()})

    def to_json(self) -> dict[str, Any]:
        return {
            "include": list(self.include) if self.include is not None else None,
            "exclude": list(self.exclude),
            "scaling": self.scaling,
            "use_fast_accum": self.use_fast_accum,
            "min_tokens": self.min_tokens,
            "fuse_gelu": self.fuse_gelu,
        }
