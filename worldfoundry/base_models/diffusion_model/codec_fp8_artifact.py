"""The schema of a LightVAE FP8 calibration artifact, checked field by field before the artifact is used.

An artifact is read with ``torch.load(weights_only=True)`` (plain containers and tensors only, nothing is
called), then :func:`check_artifact_schema` checks every field's type, range and size. Each malformed field is
a :class:`~worldfoundry.errors.CalibrationArtifactError` naming the file and the key
(``checkpoint.sha256``, ``convolutions['encoder.conv_in'].amax``), never a Python error from deeper code.

Fields (all required except ``fp8_dtype``; no others are accepted)::

    format: "worldfoundry-lightvae-fp8-v1"     variant: "lightvae-wan21"     fp8_dtype: "float8_e4m3fn"
    checkpoint: {path: str | null, size_bytes: int >= 0 | null, sha256: 64 hex digits | null}
    encoder_parameters_sha256: 64 hex digits
    tensor_structure: [[name: str, shape: [int >= 0, ...], dtype: str], ...]
    calibration: {sources: [{path: str, sha256: 64 hex | null, shape: [int, ...]}], frames: int >= 1,
                  include: [str, ...], created_at: str, torch: str, diffusers: str, device: str}
    convolutions: {path: {geometry: {...}, amax: finite number >= 0 (0-d float tensor or number), calls: int >= 0}}
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Final

import torch

from worldfoundry.errors import CalibrationArtifactError

ARTIFACT_FORMAT: Final = "worldfoundry-lightvae-fp8-v1"
FP8_DTYPE: Final = "float8_e4m3fn"
REQUIRED_FIELDS: Final = ("format", "variant", "checkpoint", "encoder_parameters_sha256", "tensor_structure",
                          "calibration", "convolutions")
OPTIONAL_FIELDS: Final = ("fp8_dtype",)
_CHECKPOINT_KEYS: Final = ("path", "size_bytes", "sha256")
_CALIBRATION_KEYS: Final = ("sources", "frames", "include", "created_at", "torch", "diffusers", "device")
_CONV_KEYS: Final = ("geometry", "amax", "calls")
_SHA256: Final = re.compile(r"[0-9a-f]{64}")
#: Bounds of the artifact's lists and strings (the student encoder has a few hundred tensors).
MAX_ITEMS: Final = 100_000
MAX_TEXT: Final = 4096
_AGAIN: Final = "; write the artifact again with benchmarks/inference/calibrate_plugins.py lightvae_fp8"


def is_sha256(value: Any) -> bool:
    """``True`` for 64 lowercase hexadecimal digits."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def _fail(file: str, key: str, message: str) -> CalibrationArtifactError:
    return CalibrationArtifactError(file, key, message + _AGAIN)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _text(file: str, key: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise _fail(file, key, f"expected a string of at most {MAX_TEXT} characters, got {_shown(value)}")


def _digest(file: str, key: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_sha256(value):
        raise _fail(file, key, f"expected a SHA256 of 64 lowercase hexadecimal digits, got {_shown(value)}")


def _mapping(file: str, key: str, value: Any, allowed: tuple[str, ...], required: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(file, key, f"expected a mapping, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise _fail(file, key, f"unknown field(s) {unknown}; known: {list(allowed)}")
    missing = [k for k in required if k not in value]
    if missing:
        raise _fail(file, key, f"lacks field(s) {missing}")
    return value


def _shape(file: str, key: str, value: Any) -> None:
    if not isinstance(value, list | tuple) or len(value) > 16 or not all(_count(s) for s in value):
        raise _fail(file, key, f"expected a shape (a list of at most 16 integers >= 0), got {_shown(value)}")


def _sequence(file: str, key: str, value: Any) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_ITEMS:
        raise _fail(file, key, f"expected a list of at most {MAX_ITEMS} items, got {type(value).__name__}")
    return value


def _check_checkpoint(file: str, value: Any) -> None:
    ckpt = _mapping(file, "checkpoint", value, _CHECKPOINT_KEYS, _CHECKPOINT_KEYS)
    _text(file, "checkpoint.path", ckpt["path"], optional=True)
    if ckpt["size_bytes"] is not None and not _count(ckpt["size_bytes"]):
        raise _fail(file, "checkpoint.size_bytes", f"expected an integer >= 0 or null, got {_shown(ckpt['size_bytes'])}")
    _digest(file, "checkpoint.sha256", ckpt["sha256"], optional=True)


def _check_structure(file: str, value: Any) -> None:
    for i, entry in enumerate(_sequence(file, "tensor_structure", value)):
        key = f"tensor_structure[{i}]"
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise _fail(file, key, f"expected [name, shape, dtype], got {_shown(entry)}")
        _text(file, f"{key}[0]", entry[0])
        _shape(file, f"{key}[1]", entry[1])
        _text(file, f"{key}[2]", entry[2])


def _check_calibration(file: str, value: Any) -> None:
    cal = _mapping(file, "calibration", value, _CALIBRATION_KEYS, ("sources", "frames", "include"))
    for i, source in enumerate(_sequence(file, "calibration.sources", cal["sources"])):
        key = f"calibration.sources[{i}]"
        entry = _mapping(file, key, source, ("path", "sha256", "shape"), ("path",))
        _text(file, f"{key}.path", entry["path"])
        _digest(file, f"{key}.sha256", entry.get("sha256"), optional=True)
        if "shape" in entry:
            _shape(file, f"{key}.shape", entry["shape"])
    if not _count(cal["frames"]) or cal["frames"] < 1:
        raise _fail(file, "calibration.frames", f"expected an integer >= 1, got {_shown(cal['frames'])}")
    for i, pattern in enumerate(_sequence(file, "calibration.include", cal["include"])):
        _text(file, f"calibration.include[{i}]", pattern)
    for key in ("created_at", "torch", "diffusers", "device"):
        if key in cal:
            _text(file, f"calibration.{key}", cal[key])


def amax_value(file: str, key: str, value: Any) -> float:
    """The ``amax`` of one convolution as a finite float >= 0.

    Raises:
        CalibrationArtifactError: not a real number or a one-element floating tensor, not finite, or negative.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point() or value.is_meta:
            raise _fail(file, key, f"expected a one-element floating tensor, got {tuple(value.shape)} {value.dtype}")
        number = float(value.detach().reshape(()).to("cpu", torch.float64))
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value) if abs(value) < 1e300 else math.inf
    else:
        raise _fail(file, key, f"expected a number, got {type(value).__name__}")
    if not math.isfinite(number) or number < 0.0:
        raise _fail(file, key, f"expected a finite number >= 0, got {number}")
    return number


def _check_convolutions(file: str, value: Any) -> None:
    if not isinstance(value, Mapping) or not value or len(value) > MAX_ITEMS:
        raise _fail(file, "convolutions", "expected a non-empty mapping of convolution path -> entry")
    for path, entry in value.items():
        if not isinstance(path, str) or len(path) > MAX_TEXT:
            raise _fail(file, "convolutions", f"keys must be convolution paths (strings), got {_shown(path)}")
        key = f"convolutions[{path!r}]"
        conv = _mapping(file, key, entry, _CONV_KEYS, ("geometry", "amax"))
        if not isinstance(conv["geometry"], Mapping):
            raise _fail(file, f"{key}.geometry", f"expected a mapping, got {type(conv['geometry']).__name__}")
        amax_value(file, f"{key}.amax", conv["amax"])
        if "calls" in conv and not _count(conv["calls"]):
            raise _fail(file, f"{key}.calls", f"expected an integer >= 0, got {_shown(conv['calls'])}")


def check_artifact_schema(data: Any, file: str, *, variant: str) -> dict[str, Any]:
    """Check every field of a decoded artifact.

    Args:
        data: what ``torch.load(weights_only=True)`` returned (or an in-memory artifact).
        file: the artifact's name for messages.
        variant: the codec variant the artifact must be for.

    Returns:
        ``data`` as a dict.

    Raises:
        CalibrationArtifactError: the first malformed field, naming ``file`` and the key.
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("format"), str) or data["format"] != ARTIFACT_FORMAT:
        found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
        raise CalibrationArtifactError(file, "format", f"not a {ARTIFACT_FORMAT} artifact (format {_shown(found)})")
    missing = [k for k in REQUIRED_FIELDS if k not in data]
    if missing:
        raise _fail(file, "$", f"artifact lacks field(s) {missing}")
    unknown = sorted(str(k) for k in data if k not in REQUIRED_FIELDS + OPTIONAL_FIELDS)
    if unknown:
        raise _fail(file, "$", f"unknown field(s) {unknown}")
    if not isinstance(data["variant"], str) or data["variant"] != variant:
        raise CalibrationArtifactError(file, "variant", f"artifact is for variant {_shown(data['variant'])}, not "
                                                        f"{variant!r}")
    if not isinstance(data.get("fp8_dtype", FP8_DTYPE), str) or data.get("fp8_dtype", FP8_DTYPE) != FP8_DTYPE:
        raise _fail(file, "fp8_dtype", f"expected {FP8_DTYPE!r}, got {_shown(data['fp8_dtype'])}")
    _check_checkpoint(file, data["checkpoint"])
    _digest(file, "encoder_parameters_sha256", data["encoder_parameters_sha256"])
    _check_structure(file, data["tensor_structure"])
    _check_calibration(file, data["calibration"])
    _check_convolutions(file, data["convolutions"])
    return dict(data)


__all__ = ["ARTIFACT_FORMAT", "REQUIRED_FIELDS", "amax_value", "check_artifact_schema", "is_sha256"]
