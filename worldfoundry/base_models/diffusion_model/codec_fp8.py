"""FP8 calibration artifacts of the LightVAE student encoder: conv selection, calibration, binding checks.

The artifact (``torch.save`` of a plain dict of strings, ints, lists and tensors, loadable with
``torch.load(weights_only=True)``) records:

* ``format`` / ``variant`` / ``fp8_dtype``;
* ``checkpoint``: the source file's path, size and SHA256;
* ``encoder_parameters_sha256`` and ``tensor_structure``: a digest and the ``[name, shape, dtype]`` list of
  the encoder's state dict the scales were measured on;
* ``calibration``: the clips (path, SHA256, shape), frames used, include patterns, versions;
* ``convolutions``: per selected ``WanCausalConv3d`` (path relative to ``AutoencoderKLWan``, e.g.
  ``encoder.down_blocks.0.conv1``) its geometry, the measured input ``amax`` and the calibration call count.

:func:`validate_artifact` refuses (``ArtifactMismatchError``) an artifact whose weights digest, tensor
structure, checkpoint hash or convolution geometry differs from the encoder it is applied to.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn

from worldfoundry.base_models.diffusion_model.codec_checkpoints import (
    STUDENT_VARIANT,
    VARIANTS,
    file_sha256,
    parameter_sha256,
    tensor_structure,
)
from worldfoundry.base_models.diffusion_model.codec_fp8_artifact import (
    ARTIFACT_FORMAT,
    amax_value,
    check_artifact_schema,
    is_sha256,
)
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.quantization.fp8_conv import ConvGeometry
from worldfoundry.core.model_loading.input_files import check_input_file
from worldfoundry.errors import (
    ArtifactMismatchError,
    CalibrationArtifactError,
    InputFileError,
    InvalidRequestError,
    QuantizationInputError,
)

if TYPE_CHECKING:
    from worldfoundry.base_models.diffusion_model.codec import WanVideoCodec

logger = logging.getLogger(__name__)

ENCODER_PREFIX: Final = "encoder."
#: Largest calibration clip file read.
MAX_CLIP_BYTES: Final = 8 << 30
DEFAULT_INCLUDE: Final = ("encoder.*",)


def causal_convolutions(encoder: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path relative to AutoencoderKLWan, module)`` of every ``WanCausalConv3d`` in the encoder."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return [(ENCODER_PREFIX + name, m) for name, m in encoder.named_modules() if isinstance(m, WanCausalConv3d)]


def select_convolutions(encoder: nn.Module, include: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """Encoder convolutions whose path matches any ``fnmatch`` pattern of ``include``.

    Raises:
        InvalidRequestError: no pattern, or nothing matched (the message lists some candidates).
    """
    patterns = [str(p) for p in include]
    if not patterns:
        raise InvalidRequestError("give at least one --include pattern (e.g. 'encoder.*')")
    candidates = causal_convolutions(encoder)
    selected = [(p, m) for p, m in candidates if any(fnmatch.fnmatchcase(p, pat) for pat in patterns)]
    if not selected:
        raise InvalidRequestError(
            f"include patterns {patterns} match no encoder convolution; candidates: {[p for p, _ in candidates][:6]} ..."
        )
    return selected


def encoder_is_student(encoder: nn.Module) -> str | None:
    """``None`` when ``encoder`` is the LightVAE student's ``WanEncoder3d``, else what it is instead."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanEncoder3d

    if not isinstance(encoder, WanEncoder3d):
        return f"{type(encoder).__name__} is not a Wan VAE encoder (WanEncoder3d)"
    base = encoder.conv_in.out_channels
    z2 = encoder.conv_out.out_channels
    student = VARIANTS[STUDENT_VARIANT]
    if base != student.base_dim or z2 != 32 or encoder.conv_in.in_channels != 3:
        return f"the encoder has base_dim {base} and {z2 // 2} latent channels, not the {student.description}"
    return None


# --------------------------------------------------------------------------------------------- clips


def load_clip(path: str | os.PathLike[str], frames: int) -> torch.Tensor:
    """Read a calibration clip (``.pt``: a BCTHW/CTHW float tensor in [-1, 1], a THWC uint8 tensor, or a dict
    with ``"video"``) and return its first ``frames`` frames as ``(1, 3, frames, H, W)`` float32.

    Raises:
        InvalidRequestError: unreadable, wrong layout, too few frames or ``frames`` not ``1 + 4k``.
    """
    if frames < 1 or (frames - 1) % 4:
        raise InvalidRequestError(f"--frames must be 1 + 4k, got {frames}")
    try:
        check_input_file(path, what="calibration clip", max_bytes=MAX_CLIP_BYTES)
    except InputFileError as exc:
        raise InvalidRequestError(str(exc)) from exc
    try:
        data = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for unreadable files
        raise InvalidRequestError(f"{path}: cannot read calibration clip ({type(exc).__name__}: {exc})") from exc
    if isinstance(data, Mapping):
        data = data.get("video")
    if not isinstance(data, torch.Tensor):
        raise InvalidRequestError(f"{path}: expected a video tensor or a dict with 'video'")
    video = data
    if video.dtype == torch.uint8:
        if video.ndim != 4 or video.shape[-1] != 3:
            raise InvalidRequestError(f"{path}: uint8 clips must be (T, H, W, 3), got {tuple(video.shape)}")
        video = (video.permute(3, 0, 1, 2).float() / 127.5 - 1.0)
    if video.ndim == 4:
        video = video.unsqueeze(0)
    if video.ndim != 5 or video.shape[1] != 3 or not video.is_floating_point():
        raise InvalidRequestError(f"{path}: expected (B, 3, T, H, W) in [-1, 1], got {tuple(video.shape)} {video.dtype}")
    if video.shape[2] < frames:
        raise InvalidRequestError(f"{path}: has {video.shape[2]} frames, fewer than --frames {frames}")
    clip = video[:1, :, :frames].float().contiguous()
    if not bool(torch.isfinite(clip).all()):
        raise InvalidRequestError(f"{path}: the clip holds NaN or Inf values; use an intact clip")
    return clip


# --------------------------------------------------------------------------------------------- calibration


def calibrate_encoder_fp8(codec: WanVideoCodec, clips: Sequence[tuple[str, torch.Tensor]], *,
                          include: Sequence[str] = DEFAULT_INCLUDE, frames: int) -> dict[str, Any]:
    """Measure the input ``amax`` of each selected encoder convolution over ``clips`` and build the artifact.

    The observation wraps ``Conv3d._conv_forward`` of each selected module (the padded, cached input the
    convolution really sees) and is removed afterwards, also on errors.

    Args:
        codec: a float32 student codec (its weights are what the artifact binds to).
        clips: ``(source path, video)`` pairs; videos are ``(1, 3, frames, H, W)`` in [-1, 1].
        include: ``fnmatch`` patterns over paths like ``encoder.down_blocks.0.conv1``.
        frames: frames per clip (recorded).

    Returns:
        The artifact dict (see the module docstring).

    Raises:
        InvalidRequestError: not the student, no clips, or nothing selected.
    """
    if codec.variant.name != STUDENT_VARIANT:
        raise InvalidRequestError(f"FP8 calibration needs variant {STUDENT_VARIANT!r}, got {codec.variant.name!r}")
    if not clips:
        raise InvalidRequestError("give at least one calibration clip (--reference)")
    if codec.fp8_session is not None:
        raise InvalidRequestError("calibrate on the FP32 codec: this codec already runs an FP8 encoder")
    encoder = codec.module.encoder
    selected = select_convolutions(encoder, include)
    amax = {path: torch.zeros((), dtype=torch.float32, device=codec.device) for path, _ in selected}
    calls = dict.fromkeys(amax, 0)

    def observer(path: str, original: Any) -> Any:
        def observe(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            torch.maximum(amax[path], input.detach().abs().amax().float(), out=amax[path])
            calls[path] += 1
            return original(input, weight, bias)

        return observe

    with PatchRecorder("lightvae-fp8-calibration") as rec:
        for path, conv in selected:
            rec.setattr(conv, "_conv_forward", observer(path, conv._conv_forward))
        for _, video in clips:
            codec.encode(video)
    sources = [
        {"path": str(p), "sha256": file_sha256(p) if Path(p).is_file() else None, "shape": list(v.shape)}
        for p, v in clips
    ]
    return build_artifact(codec, selected, amax, calls, sources=sources, include=include, frames=frames)


def build_artifact(codec: WanVideoCodec, selected: Sequence[tuple[str, nn.Module]], amax: Mapping[str, torch.Tensor],
                   calls: Mapping[str, int], *, sources: list[dict[str, Any]], include: Sequence[str],
                   frames: int) -> dict[str, Any]:
    """Assemble the artifact dict from measured ``amax`` values (all plain types and CPU tensors)."""
    import diffusers

    encoder_state = codec.module.encoder.state_dict()
    source = codec.source
    convolutions = {}
    for path, conv in selected:
        value = amax[path].detach().float().cpu()
        if not torch.isfinite(value) or calls[path] == 0:
            raise InvalidRequestError(f"{path}: calibration saw no finite input ({calls[path]} calls, amax {value.item()})")
        convolutions[path] = {"geometry": ConvGeometry.from_conv(conv).to_json(), "amax": value, "calls": int(calls[path])}
    return {
        "format": ARTIFACT_FORMAT,
        "variant": STUDENT_VARIANT,
        "fp8_dtype": "float8_e4m3fn",
        "checkpoint": {
            "path": source.path if source is not None else None,
            "size_bytes": source.size_bytes if source is not None else None,
            "sha256": (source.sha256 or file_sha256(source.path)) if source is not None else None,
        },
        "encoder_parameters_sha256": parameter_sha256(encoder_state),
        "tensor_structure": tensor_structure(encoder_state),
        "calibration": {
            "sources": sources,
            "frames": int(frames),
            "include": [str(p) for p in include],
            "created_at": datetime.now(timezone.utc).isoformat(),
            "torch": str(torch.__version__),
            "diffusers": str(diffusers.__version__),
            "device": str(codec.device),
        },
        "convolutions": convolutions,
    }


def save_artifact(artifact: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write the artifact with ``torch.save`` (creating the parent directory) and return its path."""
    out = Path(os.fspath(path))
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(artifact), out)
    return out


# --------------------------------------------------------------------------------------------- binding


#: Largest calibration artifact file read (a student artifact is a few hundred KiB).
MAX_ARTIFACT_BYTES: Final = 256 << 20


def load_artifact(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read an artifact with ``torch.load(weights_only=True)`` and check every field of its schema.

    The file is stat-checked first (a regular file of at most :data:`MAX_ARTIFACT_BYTES`; directories, FIFOs
    and devices such as ``/dev/zero`` are refused before any byte is read).

    Raises:
        ArtifactMismatchError: missing file, not a regular file, too large, unreadable or another format.
        CalibrationArtifactError: a malformed field (an :class:`ArtifactMismatchError` naming file and key).
    """
    p = Path(os.fspath(path))
    if not p.exists():
        raise ArtifactMismatchError(f"FP8 calibration artifact {p} does not exist")
    try:
        check_input_file(p, what="FP8 calibration artifact", max_bytes=MAX_ARTIFACT_BYTES)
    except InputFileError as exc:
        raise ArtifactMismatchError(str(exc)) from exc
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for unreadable files
        raise ArtifactMismatchError(f"{p}: not a readable calibration artifact ({type(exc).__name__}: {exc})") from exc
    return check_artifact_schema(data, str(p), variant=STUDENT_VARIANT)


@dataclass(frozen=True)
class BoundConvolution:
    """One artifact entry matched to a live convolution."""

    path: str  # relative to AutoencoderKLWan, e.g. "encoder.down_blocks.0.conv1"
    relative_path: str  # relative to the encoder, e.g. "down_blocks.0.conv1"
    module: nn.Module
    geometry: ConvGeometry
    amax: float
    calibration_calls: int


def validate_artifact(artifact: Mapping[str, Any], encoder: nn.Module, *,
                      checkpoint_sha256: str | None = None, where: str = "artifact") -> list[BoundConvolution]:
    """Match an artifact to a student encoder; refuse any difference before anything is changed.

    Args:
        artifact: from :func:`load_artifact`.
        encoder: the ``AutoencoderKLWan.encoder`` it will be applied to.
        checkpoint_sha256: SHA256 of the file the encoder was loaded from, when known.

    Returns:
        The bound convolutions, in artifact order.

    Raises:
        CalibrationArtifactError: a malformed field of the artifact, or a ``checkpoint_sha256`` that is not 64
            hexadecimal digits.
        ArtifactMismatchError: not the student, other weights (digest/structure/checkpoint hash), unknown
            convolution paths or different geometry.
    """
    check_artifact_schema(artifact, where, variant=STUDENT_VARIANT)
    if checkpoint_sha256 is not None and not is_sha256(checkpoint_sha256):
        raise CalibrationArtifactError(where, "checkpoint_sha256", "the codec's checkpoint SHA256 must be 64 lowercase "
                                       f"hexadecimal digits, got {str(checkpoint_sha256)[:70]!r}")
    problem = encoder_is_student(encoder)
    if problem is not None:
        raise ArtifactMismatchError(f"{where}: {problem}")
    recorded_sha = artifact["checkpoint"]["sha256"]
    if checkpoint_sha256 is not None and recorded_sha is not None and recorded_sha != checkpoint_sha256:
        raise ArtifactMismatchError(
            f"{where} was calibrated on checkpoint SHA256 {recorded_sha}, the codec was loaded from SHA256 "
            f"{checkpoint_sha256}; calibrate again for this checkpoint"
        )
    state = encoder.state_dict()
    structure = tensor_structure(state)
    if structure != [list(x) for x in artifact["tensor_structure"]]:
        raise ArtifactMismatchError(f"{where}: the encoder's tensor structure (names/shapes/dtypes) differs from the artifact's")
    digest = parameter_sha256(state)
    if digest != artifact["encoder_parameters_sha256"]:
        raise ArtifactMismatchError(
            f"{where} was calibrated on encoder weights {artifact['encoder_parameters_sha256'][:16]}..., these are "
            f"{digest[:16]}...; calibrate again for these weights"
        )
    live = dict(causal_convolutions(encoder))
    bound = []
    for path, entry in artifact["convolutions"].items():
        conv = live.get(path)
        if conv is None:
            raise ArtifactMismatchError(f"{where}: convolution {path!r} does not exist in the encoder")
        try:
            recorded = ConvGeometry.from_json(entry["geometry"])
            actual = ConvGeometry.from_conv(conv)
        except (QuantizationInputError, KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CalibrationArtifactError(where, f"convolutions[{path!r}].geometry", f"{type(exc).__name__}: {exc}") from exc
        if recorded != actual:
            raise ArtifactMismatchError(f"{where}: {path} geometry {actual.to_json()} differs from the recorded {recorded.to_json()}")
        amax = amax_value(where, f"convolutions[{path!r}].amax", entry["amax"])
        bound.append(BoundConvolution(path, path[len(ENCODER_PREFIX):], conv, actual, amax, int(entry.get("calls", 0))))
    if not bound:
        raise ArtifactMismatchError(f"{where}: the artifact selects no convolution")
    return bound


__all__ = [
    "ARTIFACT_FORMAT",
    "DEFAULT_INCLUDE",
    "BoundConvolution",
    "build_artifact",
    "calibrate_encoder_fp8",
    "causal_convolutions",
    "encoder_is_student",
    "load_artifact",
    "load_clip",
    "save_artifact",
    "select_convolutions",
    "validate_artifact",
]
