"""LightVAE FP8 encoder options: a frozen, validated dataclass built from the spec mapping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from worldfoundry.plugin import (
    OptionValueError,
    PluginOptions,
    boolean,
    choice,
    file_path,
    integer,
    option,
    optional,
    string,
)

PLUGIN_NAME: Final = "lightvae"
BACKENDS: Final = ("auto", "scaled_mm", "reference")
#: Largest im2col chunk bound in MiB (1 TiB).
MAX_WORKSPACE_MB: Final = 1 << 20


@dataclass(frozen=True)
class Options(PluginOptions):
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

    plugin_name: ClassVar[str] = PLUGIN_NAME

    calibration: str | None = option(None, optional(file_path(expected="the path of an FP8 calibration artifact")))
    backend: str = option("auto", choice(*BACKENDS))
    count_clipping: bool = option(True, boolean())
    checkpoint_sha256: str | None = option(None, optional(string(min_length=64, max_length=64,
                                                                 expected="64 hex digits")))
    workspace_mb: int = option(256, integer(min=1, max=MAX_WORKSPACE_MB))

    def validate(self) -> None:
        if self.calibration is None:
            raise OptionValueError(
                "calibration", "the path of an FP8 calibration artifact is required "
                "(benchmarks/inference/calibrate_plugins.py lightvae_fp8 writes one)")
