"""``selective_fp8`` options: a frozen, validated dataclass built from the spec mapping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final

from worldfoundry.plugin import OptionValueError, PluginOptions, boolean, integer, option, optional, shown_value

PLUGIN_NAME: Final = "selective_fp8"
SCALINGS: Final = ("rowwise",)
#: Most patterns in one list, and the longest pattern.
MAX_PATTERNS: Final = 4096
MAX_PATTERN_LENGTH: Final = 4096


def _patterns(value: Any, path: str) -> tuple[str, ...]:
    """A list of non-empty module-name patterns, stripped; a bare string is refused with the fix."""
    if not isinstance(value, list | tuple) or len(value) > MAX_PATTERNS:
        hint = f"; write [{shown_value(value)}]" if isinstance(value, str) else ""
        raise OptionValueError(path, f"expected a list of module-name patterns, got {shown_value(value)}{hint}")
    for item in value:
        if not isinstance(item, str) or not item.strip() or len(item) > MAX_PATTERN_LENGTH:
            raise OptionValueError(path, f"patterns must be non-empty strings, got {shown_value(item)}")
    return tuple(item.strip() for item in value)


def _scaling(value: Any, path: str) -> str:
    if not isinstance(value, str) or value not in SCALINGS:
        raise OptionValueError(path, f"only {list(SCALINGS)} is supported, got {shown_value(value)}")
    return value


@dataclass(frozen=True)
class Options(PluginOptions):
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

    plugin_name: ClassVar[str] = PLUGIN_NAME

    include: tuple[str, ...] | None = option(None, optional(_patterns))
    exclude: tuple[str, ...] = option((), _patterns)
    scaling: str = option("rowwise", _scaling)
    use_fast_accum: bool = option(False, boolean(expected="true/false"))
    min_tokens: int = option(1024, integer(min=0))
    fuse_gelu: bool = option(True, boolean(expected="true/false"))

    def validate(self) -> None:
        if self.include == ():
            raise OptionValueError("include", "give at least one pattern (or leave it out)")
