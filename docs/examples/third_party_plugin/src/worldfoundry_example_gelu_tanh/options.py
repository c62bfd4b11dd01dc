"""Frozen, validated options of ``example_gelu_tanh``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from worldfoundry.plugin import PluginOptions, integer, option, optional, sequence_of

PLUGIN_NAME: Final = "example_gelu_tanh"


@dataclass(frozen=True)
class Options(PluginOptions):
    """Options of ``example_gelu_tanh``.

    Attributes:
        blocks: indices of the Wan blocks whose FFN activation is replaced; ``None`` means every block.
        min_numel: activations with fewer elements run the original GELU, recorded as a fallback.

    Example:
        >>> Options.from_mapping({"blocks": [0, 1]})
        Options(blocks=(0, 1), min_numel=0)
    """

    plugin_name: ClassVar[str] = PLUGIN_NAME
    error_format: ClassVar[str] = "{path} must be {expected}, got {value}"

    blocks: tuple[int, ...] | None = option(
        None, optional(sequence_of(integer(min=0), unique=True, expected="a list of block indices")))
    min_numel: int = option(0, integer(min=0))
