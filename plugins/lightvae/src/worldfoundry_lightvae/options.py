"""LightVAE FP8 encoder options: a frozen, validated dataclass built from the spec mapping."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Final

from worldfoundry.errors import AccelerationOptionsError

PLUGIN_NAME: Final = "lightvae"
BACKENDS: Final = ("auto", "scaled_mm", "reference")


@dataclass(frozen=True)
class Options:
    """Options of the ``lightvae`` acceleration (FP8 student encoder).

    Args:
        calibration: path of the calibration artifact (``calibrate_plugins.py lightvae_fp8``). Required.
        backend: ``"auto"``: FP8 ``torch._scaled_mm`` on CUDA sm_89+, a visible dense fallback (with its
            reason in the receipts) elsewhere; ``"scaled_mm"``: the FP8 GEMM path wherever
            ``torch._scaled_mm`` accepts FP8 (refused otherwise); ``"reference"``: the dequantized torch
            reference of the same function (any device, for verification).
        count_clipping: count inputs beyond the calibrated ``amax`` (one extra reduction per convolution).
        checkpoint_sha256: SHA256 of the checkpoint file the codec was loaded from; when given it must equal
            the artifact's.
        workspace_mb: bound of one im2col chunk in MiB.

    Raises:
        AccelerationOptionsError: missing calibration, unknown key, wrong type or value.

    Example:
        >>> Options.from_mapping({"calibration": "lightvae-fp8.pt"}).backend
        'auto'
    """

    calibration: str = ""
    backend: str = "auto"
    count_clipping: bool = True
    checkpoint_sha256: str | None = None
    workspace_mb: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.calibration, os.PathLike):
            object.__setattr__(self, "calibration", os.fspath(self.calibration))
        if not isinstance(self.calibration, str) or not self.calibration:
            raise AccelerationOptionsError(
                PLUGIN_NAME, "calibration: the path of an FP8 calibration artifact is required "
                "(benchmarks/inference/calibrate_plugins.py lightvae_fp8 writes one)"
            )
        if self.backend not in BACKENDS:
            raise AccelerationOptionsError(PLUGIN_NAME, f"backend: expected one of {list(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.count_clipping, bool):
            raise AccelerationOptionsError(PLUGIN_NAME, f"count_clipping: expected true/false, got {self.count_clipping!r}")
        sha = self.checkpoint_sha256
        if sha is not None and (not isinstance(sha, str) or len(sha) != 64):
            raise AccelerationOptionsError(PLUGIN_NAME, f"checkpoint_sha256: expected 64 hex digits, got {sha!r}")
        mb = self.workspace_mb
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise AccelerationOptionsError(PLUGIN_NAME, f"workspace_mb: expected an integer >= 1, got {mb!r}")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> Options:
        """Build from the spec mapping; unknown keys are rejected by name.

        Raises:
            AccelerationOptionsError: unknown key, missing calibration, wrong type or value.
        """
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise AccelerationOptionsError(PLUGIN_NAME, f"options: expected a mapping, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise AccelerationOptionsError(PLUGIN_NAME, f"unknown option(s) {unknown}; known options: {sorted(known)}")
        return cls(**{str(k): v for k, v in options.items()})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
