"""Options of the Wan video codec: which are refused (named), the build purpose and the dtype.

The first codec version runs float32, resident, untiled inference on one device. Every option of
:data:`REFUSED_OPTIONS` is accepted only when switched off (``False``, ``None``, ``0``, ``"off"``...);
anything else raises :class:`~worldfoundry.errors.UnsupportedCodecOptionError` naming the option.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch

from worldfoundry.base_models.diffusion_model.codec_checkpoints import (
    STUDENT_VARIANT,
    TEACHER_VARIANT,
    CodecVariant,
    get_variant,
)
from worldfoundry.base_models.runtime_options import VAE_FP8_CALIBRATION
from worldfoundry.core.model_loading.policy import dtype_name, parse_device, parse_dtype
from worldfoundry.errors import PolicyError, UnsupportedCodecOptionError

#: FP8 encoder backends of the student codec.
FP8_BACKENDS: Final = ("auto", "scaled_mm", "reference")

_OFF_VALUES: Final = (None, False, 0, "none", "off", "false", "no", "disabled")

#: Options the first codec version refuses when switched on, with the reason given.
REFUSED_OPTIONS: Final[dict[str, str]] = {
    **dict.fromkeys(("tiled", "tiling", "enable_tiling", "use_tiling"),
                    "tiling is not supported; the codec runs untiled and resident (pass tiled=False)"),
    **dict.fromkeys(("temporal_chunk", "temporal_chunking", "temporal_chunk_frames", "chunk_frames"),
                    "extra temporal chunking is not supported; the causal cache already processes 4-frame chunks"),
    **dict.fromkeys(("parallel_decode", "decode_parallel"), "parallel decode is not supported"),
    **dict.fromkeys(("offload", "cpu_offload", "group_offload", "enable_model_cpu_offload"),
                    "offload is not supported; the codec stays resident on its device"),
    **dict.fromkeys(("quantization", "quantize", "quantization_config"),
                    "generic quantization is not supported; the only low-precision path is the calibrated FP8 "
                    "student encoder (fp8_calibration / vae_fp8_calibration)"),
    **dict.fromkeys(("compile", "torch_compile"), "torch.compile is not supported"),
    **dict.fromkeys(("cuda_graph", "cuda_graphs", "graphs"), "CUDA graphs are not supported"),
    **dict.fromkeys(("sequence_parallel", "sp", "context_parallel", "parallel_config"),
                    "sequence/context parallelism is not supported"),
    **dict.fromkeys(("autocast", "amp"), "autocast/low precision is not supported; the codec runs in float32"),
}


def _is_off(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in _OFF_VALUES
    return any(value is v or (type(value) is type(v) and value == v) for v in _OFF_VALUES)


def refuse_codec_options(options: Mapping[str, Any]) -> None:
    """Refuse every option of :data:`REFUSED_OPTIONS` that is switched on, and every unknown option.

    Raises:
        UnsupportedCodecOptionError: naming the option.
    """
    for name, value in options.items():
        reason = REFUSED_OPTIONS.get(name)
        if reason is None:
            raise UnsupportedCodecOptionError(
                name, f"unknown codec option; accepted: variant, device, dtype, fp8_calibration, fp8_backend, "
                f"purpose, and (switched off only) {', '.join(sorted(REFUSED_OPTIONS))}"
            )
        if not _is_off(value):
            raise UnsupportedCodecOptionError(name, f"{reason} (got {value!r})")


def check_purpose_and_dtype(purpose: str, dtype: Any) -> torch.dtype:
    """The float32 dtype for an ``"inference"`` build; anything else is refused by name.

    Raises:
        UnsupportedCodecOptionError: another purpose or a dtype other than float32.
    """
    if purpose != "inference":
        raise UnsupportedCodecOptionError(
            "purpose", f"only build purpose 'inference' is supported, got {purpose!r} (training/export are not)"
        )
    try:
        parsed = parse_dtype(dtype, field_name="dtype")
    except PolicyError as exc:
        raise UnsupportedCodecOptionError("dtype", str(exc)) from exc
    if parsed != torch.float32:
        raise UnsupportedCodecOptionError(
            "dtype", f"low precision ({dtype_name(parsed)}) is not supported; the codec runs in float32"
        )
    return parsed


__all__ = ["REFUSED_OPTIONS", "check_purpose_and_dtype", "refuse_codec_options"]


def refuse_calibration_for_recipe_codec(codec_options: Mapping[str, Any], runtime_options: Mapping[str, Any]) -> None:
    """Refuse the runtime option ``vae_fp8_calibration`` when the recipe's own codec (no FP8 encoder) is chosen.

    Args:
        codec_options: the codec's component options (``component_options["latent_encoder:codec"]``).
        runtime_options: the runtime policy's options.

    Raises:
        UnsupportedCodecOptionError: a calibration path without the student codec's variant.
    """
    if codec_options.get("variant", TEACHER_VARIANT) == TEACHER_VARIANT and runtime_options.get(VAE_FP8_CALIBRATION):
        raise UnsupportedCodecOptionError(
            VAE_FP8_CALIBRATION, "not available for the recipe's own codec (options: tiled, dtype, variant); FP8 "
            "encoder calibration needs the student codec's variant in component_options['latent_encoder:codec']")


def check_load_arguments(variant: str, device: Any, dtype: Any, fp8_calibration: Any, fp8_backend: str,
                         purpose: str, refused_options: Mapping[str, Any]) -> tuple[CodecVariant, torch.device]:
    """Check ``load_wan_video_codec``'s arguments before anything is read.

    Returns:
        ``(variant spec, target device)``.

    Raises:
        UnsupportedCodecOptionError: a refused option, a non-float32 dtype, FP8 with the teacher, an unknown FP8
            backend or an unusable device.
    """
    refuse_codec_options(refused_options)
    check_purpose_and_dtype(purpose, dtype)
    spec = get_variant(variant)
    if fp8_calibration is not None and spec.name != STUDENT_VARIANT:
        raise UnsupportedCodecOptionError(
            "vae_fp8_calibration", f"FP8 encoder calibration requires variant={STUDENT_VARIANT!r}, got {spec.name!r}"
        )
    if fp8_backend not in FP8_BACKENDS:
        raise UnsupportedCodecOptionError("fp8_backend", f"expected one of {FP8_BACKENDS}, got {fp8_backend!r}")
    try:
        target = parse_device(device)
    except PolicyError as exc:
        raise UnsupportedCodecOptionError("device", str(exc)) from exc
    if target.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedCodecOptionError("device", f"{target} requested but CUDA is not available; pass device='cpu'")
    return spec, target
