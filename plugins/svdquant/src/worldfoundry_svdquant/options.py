"""``svdquant`` options: a frozen, validated dataclass built from the spec mapping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from worldfoundry.plugin import (
    OptionValueError,
    PluginOptions,
    boolean,
    choice,
    option,
    optional,
    sequence_of,
    string,
)

PLUGIN_NAME: Final = "svdquant"
KEEP_ORIGINAL: Final = ("device", "cpu")
BACKENDS: Final = ("auto", "w4f8", "w4a8", "w4a16", "reference")


@dataclass(frozen=True)
class Options(PluginOptions):
    """SVDQuant options.

    Args:
        artifact: path of the calibration artifact (``.json`` manifest beside its ``.safetensors``, or ``.pt``)
            written by ``worldfoundry calibrate svdquant``; it is bound to the weights it was calibrated on.
        include: fnmatch patterns selecting a subset of the artifact's Linears (original Wan names such as
            ``blocks.*.ffn.0`` are accepted); ``None`` uses every Linear of the artifact.
        keep_original: ``"device"`` keeps the dense weights where they are (dense fallback possible, memory
            grows by the quantized tensors); ``"cpu"`` moves them to pinned host memory for exact undo, so
            device weight memory drops (about 3.5x for the selected Linears at rank 32, group 128).
        backend: ``"auto"`` (on sm_90+ W4F8 for per-channel artifacts and W4A8 for group-wise ones, W4A16 on
            other CUDA GPUs, the torch reference on the CPU), ``"w4f8"``, ``"w4a8"``, ``"w4a16"`` or
            ``"reference"``.
        fast_accum: W4F8 only: ``torch._scaled_mm``'s fast accumulation (default true; on the H200 W81 FFN
            shapes it changed the Linear's relative L2 to bf16 by less than 1e-4 and saved 10-15 %).
        fuse_gelu: when both Linears of a diffusers ``FeedForward`` run W4F8, compute the GELU, the smoothing and
            the down projection's FP8 quantization in one kernel (:mod:`.ffn_fusion`); when both run W4A8 on a
            bfloat16 model, the GELU, the smoothing, the INT8 quantization and the low-rank down projection
            (:mod:`.ffn_fusion_w4a8`).
        one_launch_operand: W4F8 only: build each activation operand -- the FP8 codes and the appended low-rank
            codes -- in one launch instead of two (the second rereads the codes); the same codes and scales
            (default false).
        activation_group: INT8 activation scales per token and group of this many input channels (64, 128 or
            256) instead of one per token: more accurate (on the trained tiny model the per-channel rank-64
            artifact comes within the draft budget with 128 or 64). Runs on ``backend: reference``, or
            ``backend: w4a8`` with a group-wise artifact of the same group size (the Triton GEMM); the GELU
            producer fusion is then off. Default ``None`` (per token).

    Raises:
        AccelerationOptionsError: missing artifact, unknown key or bad value (the message names the path).

    Example:
        >>> Options.from_mapping({"artifact": "svdquant.json", "keep_original": "cpu"}).keep_original
        'cpu'
    """

    plugin_name: ClassVar[str] = PLUGIN_NAME
    artifact: str | None = option(None, optional(string()))
    include: tuple[str, ...] | None = option(None, optional(sequence_of(string(), min_items=1)))
    keep_original: str = option("device", choice(*KEEP_ORIGINAL))
    backend: str = option("auto", choice(*BACKENDS))
    fast_accum: bool = option(True, boolean(expected="true/false"))
    fuse_gelu: bool = option(True, boolean(expected="true/false"))
    one_launch_operand: bool = option(False, boolean(expected="true/false"))
    activation_group: int | None = option(None, optional(choice(64, 128, 256, expected="64, 128 or 256")))

    def validate(self) -> None:
        if self.activation_group is not None and self.backend not in ("reference", "w4a8"):
            raise OptionValueError(
                "activation_group", f"runs on backend reference or w4a8 (group-wise artifacts), not {self.backend!r}; "
                "set backend: reference or backend: w4a8")
        if self.artifact is None:
            raise OptionValueError(
                "artifact", "required: the path of a worldfoundry-svdquant-v1 artifact "
                "(write one with `worldfoundry calibrate svdquant --out svdquant.json`)")
