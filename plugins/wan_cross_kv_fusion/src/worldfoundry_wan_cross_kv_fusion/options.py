"""Frozen, validated options of ``wan_cross_kv_fusion``.

Spec::

    {"wan_cross_kv_fusion": {"min_tokens": 256, "include_image": false, "pack": true}}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from worldfoundry.plugin import PluginOptions, boolean, integer, option

PLUGIN_NAME: Final = "wan_cross_kv_fusion"


@dataclass(frozen=True)
class Options(PluginOptions):
    """Options of ``wan_cross_kv_fusion``.

    Attributes:
        min_tokens: key/value tokens per sample (the rows the packed projection multiplies: text tokens for the
            text K/V, image tokens for the image K/V) below which the original separate projections run,
            uncached, and are counted as dense bypasses.
        include_image: also pack and cache the image K/V (``add_k_proj``/``add_v_proj``) of Wan I2V models.
        pack: compute K and V with one GEMM on a derived packed copy of their weights (adds the bytes of the K/V
            weights). ``False``: no copy, zero added weight memory; the original projections compute what the
            cache does not hold (inside a request that is the first step of each CFG branch and expert).
    """

    plugin_name: ClassVar[str] = PLUGIN_NAME
    error_format: ClassVar[str] = "{path} must be {expected}, got {value}"

    min_tokens: int = option(256, integer(min=0))
    include_image: bool = option(False, boolean())
    pack: bool = option(True, boolean())

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any], *, path: str = "") -> Options:
        """Build from the read-only mapping the installer passes to ``prepare`` (``None`` is refused).

        Raises:
            AccelerationOptionsError: not a mapping, an unknown key, or an invalid value.
        """
        return super().from_mapping(cls.check_mapping(options, path=path), path=path)
