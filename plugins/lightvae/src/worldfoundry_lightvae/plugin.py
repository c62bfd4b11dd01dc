"""Entry point of the ``lightvae`` acceleration: the calibrated FP8 encoder of the LightVAE Wan2.1 student.

The student codec itself is chosen at load time (``load_wan_video_codec(path, variant="lightvae-wan21")`` or
the codec component options of a pipeline); this acceleration is installed on that codec's encoder
(``codec.module.encoder``) and runs the selected convolutions in FP8. ``load_wan_video_codec(...,
fp8_calibration=path)`` and the runtime option ``vae_fp8_calibration`` install it for you.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

import worldfoundry
from worldfoundry.base_models.diffusion_model.codec_fp8 import (
    encoder_is_student,
    load_artifact,
    validate_artifact,
)
from worldfoundry.core.acceleration.quantization.fp8_conv import (
    fp8_gemm_unavailable_reason,
    scaled_mm_unavailable_reason,
)
from worldfoundry.plugin import (
    ROLE_OFFLOAD,
    ROLE_QUANTIZATION,
    AccelerationRefusedError,
    PreparedAcceleration,
    RuntimePolicy,
    refuse_common,
    refuse_module_hooks,
)
from worldfoundry_lightvae.fp8_encoder import (
    MODE_FALLBACK,
    MODE_REFERENCE,
    MODE_SCALED_MM,
    Fp8EncoderHandle,
    activate_fp8_encoder,
)
from worldfoundry_lightvae.options import PLUGIN_NAME, Options


def resolve_backend(backend: str, device: torch.device) -> tuple[str, str | None]:
    """``(mode, fallback reason)`` for the requested backend on ``device``.

    Raises:
        AccelerationRefusedError: ``"scaled_mm"`` was asked for where ``torch._scaled_mm`` cannot run FP8.
    """
    if backend == "reference":
        return MODE_REFERENCE, None
    if backend == "scaled_mm":
        reason = scaled_mm_unavailable_reason(device)
        if reason is not None:
            raise AccelerationRefusedError(PLUGIN_NAME, f"backend 'scaled_mm': {reason}")
        return MODE_SCALED_MM, None
    reason = fp8_gemm_unavailable_reason(device)
    return (MODE_SCALED_MM, None) if reason is None else (MODE_FALLBACK, reason)


def _refuse_not_student(model: nn.Module) -> None:
    """Refuse anything but the LightVAE student's encoder, saying where to install instead."""
    problem = encoder_is_student(model)
    if problem is not None:
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"{problem}; install it on the LightVAE student's encoder (codec.module.encoder), e.g. "
            "with load_wan_video_codec(path, variant='lightvae-wan21', fp8_calibration=artifact)"
        )


def _notes(mode: str, reason: str | None, device: torch.device) -> tuple[str, ...]:
    """The receipt's notes: what is approximate, and which backend runs (or why every call falls back)."""
    notes = [
        ("algorithmically approximate: LightVAE is a different learned codec, and its encoder convolutions run "
         "with FP8 e4m3 inputs (static calibrated per-tensor scale) and weights (per-output-channel scale)"),
    ]
    if mode == MODE_FALLBACK:
        notes.append(f"dense FP32 fallback on every selected convolution: {reason}")
    elif mode == MODE_REFERENCE:
        notes.append("torch reference backend (dequantized FP8 through F.conv3d): numerics check, not an acceleration")
    elif device.type != "cuda":
        notes.append(f"torch._scaled_mm on {device.type}: numerics check, not an acceleration")
    return tuple(notes)


def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
    """Validate options, model and artifact; return the plan (the model is not changed).

    Args:
        model: the LightVAE student's encoder (``AutoencoderKLWan(base_dim=24).encoder``).
        options: see :class:`~worldfoundry_lightvae.options.Options` (``calibration`` is required).
        policy: the runtime policy (unused; the encoder runs where its weights are).

    Returns:
        A plan claiming every selected convolution and the quantization role.

    Raises:
        AccelerationOptionsError: unknown option or invalid value.
        AccelerationRefusedError: not the student encoder, compile/graphs/SP/hooks/training, already patched
            convolutions, or an unavailable explicit backend.
        ArtifactMismatchError: the artifact belongs to other weights, another checkpoint or another geometry.
    """
    opts = Options.from_mapping(options)
    refuse_common(model, PLUGIN_NAME)
    _refuse_not_student(model)
    artifact = load_artifact(opts.calibration)
    bound = validate_artifact(artifact, model, checkpoint_sha256=opts.checkpoint_sha256, where=opts.calibration)
    refuse_module_hooks(((b.relative_path, b.module) for b in bound), PLUGIN_NAME)
    for entry in bound:
        if "_conv_forward" in entry.module.__dict__:
            raise AccelerationRefusedError(PLUGIN_NAME, f"{entry.relative_path} already has a patched convolution")
    device = next(model.parameters()).device
    mode, reason = resolve_backend(opts.backend, device)

    def activate() -> Fp8EncoderHandle:
        return activate_fp8_encoder(bound, opts, mode=mode, fallback_reason=reason)

    receipt_options = {
        **opts.to_json(),
        "resolved_backend": mode,
        "fallback_reason": reason,
        "convolutions": len(bound),
        "artifact_checkpoint_sha256": artifact["checkpoint"].get("sha256"),
        "calibration_sources": [s.get("path") for s in artifact["calibration"].get("sources", [])],
        "algorithmically_approximate": True,
    }
    return PreparedAcceleration(
        name=PLUGIN_NAME,
        claims=frozenset({b.relative_path for b in bound} | {ROLE_QUANTIZATION}),
        activate=activate,
        incompatible_with=frozenset({ROLE_OFFLOAD}),
        options=receipt_options,
        exact=False,
        notes=_notes(mode, reason, device),
    )


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Register the ``lightvae`` acceleration."""
    register(PLUGIN_NAME, prepare, options=Options)


__all__ = ["prepare", "register_diffusion_accelerations", "resolve_backend"]
