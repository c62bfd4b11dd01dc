"""Frozen, validated options of ``example_gelu_tanh``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from worldfoundry.errors import AccelerationOptionsError

PLUGIN_NAME: Final = "example_gelu_tanh"


@dataclass(frozen=True)
class Options:
    """Options of ``example_gelu_tanh``.

    Attributes:
        blocks: indices of the Wan blocks whose FFN activation is replaced; ``None`` means every block.
        min_numel: activations with fewer elements run the original GELU, recorded as a fallback.
    """

    blocks: tuple[int, ...] | None = None
    min_numel: int = 0

    def __post_init__(self) -> None:
        if self.blocks is not None:
            if isinstance(self.blocks, str | bytes) or not all(
                isinstance(b, int) and not isinstance(b, bool) for b in self.blocks
            ):
                raise AccelerationOptionsError(
                    PLUGIN_NAME, f"blocks must be a list of block indices, got {self.blocks!r}"
                )
            blocks = tuple(self.blocks)
            if any(b < 0 for b in blocks):
                raise AccelerationOptionsError(PLUGIN_NAME, f"blocks must be non-negative, got {list(blocks)}")
            if len(set(blocks)) != len(blocks):
                raise AccelerationOptionsError(PLUGIN_NAME, f"blocks lists an index twice: {list(blocks)}")
            object.__setattr__(self, "blocks", blocks)
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise AccelerationOptionsError(PLUGIN_NAME, f"min_numel must be an integer >= 0, got {self.min_numel!r}")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> Options:
        """Build from the read-only mapping the installer passes to ``prepare``.

        Raises:
            AccelerationOptionsError: ``options`` is not a mapping, has an unknown key, or a value is invalid.
        """
        if not isinstance(options, Mapping):
            raise AccelerationOptionsError(PLUGIN_NAME, f"options must be a mapping, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise AccelerationOptionsError(PLUGIN_NAME, f"unknown option(s) {unknown}; known options: {sorted(known)}")
        values = dict(options)
        if values.get("blocks") is not None and not isinstance(values["blocks"], str | bytes):
            try:
                values["blocks"] = tuple(values["blocks"])
            except TypeError:
                raise AccelerationOptionsError(
                    PLUGIN_NAME, f"blocks must be a list of block indices, got {values['blocks']!r}"
                ) from None
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return {"blocks": list(self.blocks) if self.blocks is not None else None, "min_numel": self.min_numel}
