"""Options of ``attention_lora``: ``{"path": ..., "rank": 8, "scale": -1.0}`` — all three required."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from worldfoundry.base_models.diffusion_model.optimizations.attention_lora_format import (
    QKV_LAYOUTS,
    QKV_PER_HEAD_INTERLEAVED,
)
from worldfoundry.plugin import AccelerationOptionsError, PluginOptions, choice, file_path, integer, number, option
from worldfoundry.plugin import optional

NAME: Final = "attention_lora"
REQUIRED_KEYS: Final = ("path", "rank", "scale")
OPTIONAL_KEYS: Final = ("qkv_layout",)
#: Largest accepted rank (a sanity bound; the Triton down kernel handles stacked ranks up to 128).
MAX_RANK: Final = 1024
_EXAMPLE: Final = '{"path": "attention-adapter.safetensors", "rank": 8, "scale": -1.0}'


@dataclass(frozen=True)
class Options(PluginOptions):
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

    plugin_name: ClassVar[str] = NAME
    error_format: ClassVar[str] = "{path} must be {expected}, got {value}"

    path: str | None = option(check=optional(file_path()))
    rank: int = option(check=integer(min=1, max=MAX_RANK))
    scale: float = option(check=number(min=-1.0, max=1.0, expected="in [-1, 1] (alpha/rank folded in)",
                                       type_expected="a number in [-1, 1]"))
    qkv_layout: str = option(QKV_PER_HEAD_INTERLEAVED, choice(*QKV_LAYOUTS))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], *, path_required: bool = True, path: str = "") -> Options:
        """Parse a spec mapping, rejecting unknown keys by name.

        Args:
            mapping: the options of the ``attention_lora`` spec entry.
            path_required: ``False`` when the adapter state is supplied in memory (then ``path`` must be absent).
            path: the JSON path of ``mapping`` for error messages.

        Returns:
            The validated :class:`Options`.

        Raises:
            AccelerationOptionsError: unknown or missing keys, or invalid values.
        """
        values = dict(cls.check_mapping(mapping, path=path))
        required = REQUIRED_KEYS if path_required else tuple(k for k in REQUIRED_KEYS if k != "path")
        missing = [k for k in required if k not in values]
        if missing:
            raise AccelerationOptionsError(
                NAME, f"missing required option(s) {missing}; give path, rank and scale together, e.g. {_EXAMPLE}")
        if not path_required:
            if "path" in values:
                raise AccelerationOptionsError(NAME, "path cannot be combined with an adapter state given in memory")
            values["path"] = None
        return cls.build(values, path=path)
