"""Frozen, validated options of ``wan_cross_kv_fusion``.

Spec::

    {"wan_cross_kv_fusion": {"min_tokens": 256, "include_image": false, "pack": true}}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from worldfoundry.errors import AccelerationOptionsError

PLUGIN_NAME: Final = "wan_cross_kv_fusion"


@dataclass(frozen=True)
class Options:
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

    min_tokens: int = 256
    include_image: bool = False
    pack: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise AccelerationOptionsError(PLUGIN_NAME, f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not isinstance(self.include_image, bool):
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"include_image must be true or false, got {self.include_image!r}"
            )
        if not isinstance(self.pack, bool):
            raise AccelerationOptionsError(PLUGIN_NAME, f"pack must be true or false, got {self.pack!r}")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> Options:
        """Build from the read-only mapping the installer passes to ``prepare``.

        Raises:
            AccelerationOptionsError: not a mapping, an unknown key, or an invalid value.
        """
        if not isinstance(options, Mapping):
            raise AccelerationOptionsError(PLUGIN_NAME, f"options must be a mapping, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise AccelerationOptionsError(PLUGIN_NAME, f"unknown option(s) {unknown}; known options: {sorted(known)}")
        return cls(**dict(options))

    def to_json(self) -> dict[str, Any]:
        return {"min_tokens": self.min_tokens, "include_image": self.include_image, "pack": self.pack}
