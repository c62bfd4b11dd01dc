"""Options of ``attention_lora``: ``{"path": ..., "rank": 8, "scale": -1.0}`` — all three required."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from worldfoundry.base_models.diffusion_model.optimizations.attention_lora_format import (
    QKV_LAYOUTS,
    QKV_PER_HEAD_INTERLEAVED,
)
from worldfoundry.errors import AccelerationOptionsError

NAME: Final = "attention_lora"
REQUIRED_KEYS: Final = ("path", "rank", "scale")
OPTIONAL_KEYS: Final = ("qkv_layout",)
#: Largest accepted rank (a sanity bound; the Triton down kernel handles stacked ranks up to 128).
MAX_RANK: Final = 1024


@dataclass(frozen=True)
class Options:
    """Validated options.

    Attributes:
        path: the ``.safetensors`` adapter file (``None`` only when the state is handed over in memory by
            :func:`~worldfoundry_attention_lora.context.apply_dit_attention_lora`).
        rank: the adapter rank; every tensor in the file must have it.
        scale: effective scale in ``[-1, 1]``, alpha/rank already folded in (``-1`` with alpha = rank subtracts
            the update once — do not also negate ``lora_B``).
        qkv_layout: row order of the MiniMax-H3 fused ``qkv_proj.lora_B``: ``"per_head_interleaved"``
            (default, the H3 PEFT attention state) or ``"qkv_blocks"`` (already ``[q; k; v]``). Ignored for Wan.

    Raises:
        AccelerationOptionsError: a value is missing, of the wrong type or out of range.
    """

    path: str | None
    rank: int
    scale: float
    qkv_layout: str = QKV_PER_HEAD_INTERLEAVED

    def __post_init__(self) -> None:
        if self.path is not None:
            if not isinstance(self.path, str | os.PathLike) or not os.fspath(self.path):
                raise AccelerationOptionsError(NAME, f"path must be a non-empty file path, got {self.path!r}")
            object.__setattr__(self, "path", os.fspath(self.path))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_RANK:
            raise AccelerationOptionsError(NAME, f"rank must be an integer in [1, {MAX_RANK}], got {self.rank!r}")
        if isinstance(self.scale, bool) or not isinstance(self.scale, int | float):
            raise AccelerationOptionsError(NAME, f"scale must be a number in [-1, 1], got {self.scale!r}")
        scale = float(self.scale)
        if not math.isfinite(scale) or not -1.0 <= scale <= 1.0:
            raise AccelerationOptionsError(
                NAME, f"scale must be in [-1, 1] (alpha/rank folded in), got {self.scale!r}"
            )
        object.__setattr__(self, "scale", scale)
        if self.qkv_layout not in QKV_LAYOUTS:
            raise AccelerationOptionsError(NAME, f"qkv_layout must be one of {list(QKV_LAYOUTS)}, got {self.qkv_layout!r}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], *, path_required: bool = True) -> Options:
        """Parse a spec mapping, rejecting unknown keys by name.

        Args:
            mapping: the options of the ``attention_lora`` spec entry.
            path_required: ``False`` when the adapter state is supplied in memory (then ``path`` must be absent).

        Returns:
            The validated :class:`Options`.

        Raises:
            AccelerationOptionsError: unknown or missing keys, or invalid values.
        """
        if not isinstance(mapping, Mapping):
            raise AccelerationOptionsError(NAME, f"options must be a mapping, got {type(mapping).__name__}")
        known = set(REQUIRED_KEYS) | set(OPTIONAL_KEYS)
        unknown = sorted(str(k) for k in mapping if k not in known)
        if unknown:
            raise AccelerationOptionsError(NAME, f"unknown option(s) {unknown}; known options: {sorted(known)}")
        required = REQUIRED_KEYS if path_required else tuple(k for k in REQUIRED_KEYS if k != "path")
        missing = [k for k in required if k not in mapping]
        if missing:
            raise AccelerationOptionsError(
                NAME, f"missing required option(s) {missing}; give path, rank and scale together, e.g. "
                      '{"path": "attention-adapter.safetensors", "rank": 8, "scale": -1.0}'
            )
        if not path_required and "path" in mapping:
            raise AccelerationOptionsError(NAME, "path cannot be combined with an adapter state given in memory")
        return cls(
            path=mapping.get("path"),
            rank=mapping["rank"],
            scale=mapping["scale"],
            qkv_layout=mapping.get("qkv_layout", QKV_PER_HEAD_INTERLEAVED),
        )

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "rank": self.rank, "scale": self.scale, "qkv_layout": self.qkv_layout}
