"""Wan video codec checkpoints: variants, key tables, strict reading and identification.

Two Wan2.1 codec variants share one architecture (diffusers :class:`~diffusers.AutoencoderKLWan`) and
differ in width:

* ``"wan2.1"`` — the Wan2.1 VAE (the *teacher*): ``base_dim=96`` → 96/192/384 feature channels.
* ``"lightvae-wan21"`` — the LightVAE student: ``base_dim=24`` → 24/48/96 feature channels. It is a
  different learned codec, so every report marks it ``algorithmically_approximate``.

Both have 16 latent channels, Wan16 latent mean/std, 8× spatial / 4× temporal compression and an encoder
with 11 ``down_blocks``. Files come in the original Wan layout (``encoder.conv1``, ``encoder.downsamples.*``,
``decoder.upsamples.*``, ``conv1``/``conv2``) or the diffusers layout. Original keys are converted with
diffusers' own :func:`~diffusers.loaders.single_file_utils.convert_wan_vae_to_diffusers`; the expected
original key/shape table is derived from ``AutoencoderKLWan(base_dim=...)`` through the inverse of that
conversion, and the inverse is checked against the conversion itself (194 keys for both variants).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from worldfoundry.core.model_loading.file_digest import file_sha256  # noqa: F401 - re-exported
from worldfoundry.errors import CheckpointError, MissingWeightsError

logger = logging.getLogger(__name__)

TEACHER_VARIANT: Final = "wan2.1"
STUDENT_VARIANT: Final = "lightvae-wan21"

#: Size and SHA256 of the published LightVAE student checkpoint (``lightvaew2_1.pth``).
STUDENT_PUBLISHED_SIZE: Final = 32_208_043
STUDENT_PUBLISHED_SHA256: Final = "d5d6b094d4829fb03b6179be2cf4589baab21c9fea1ca70dcaa8c85ba8183ec9"
#: Number of tensors in an original-layout Wan2.1 VAE checkpoint (teacher and student alike).
ORIGINAL_KEY_COUNT: Final = 194

ORIGINAL_SUFFIXES: Final = (".pth", ".pt", ".ckpt", ".bin")
SAFETENSORS_SUFFIX: Final = ".safetensors"
DIFFUSERS_WEIGHT_FILES: Final = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
#: Largest codec checkpoint file read (the Wan2.1 VAE is about 500 MB).
MAX_CODEC_FILE_BYTES: Final = 8 << 30


@dataclass(frozen=True)
class CodecVariant:
    """One Wan2.1 codec variant.

    Attributes:
        name: ``"wan2.1"`` or ``"lightvae-wan21"``.
        base_dim: ``AutoencoderKLWan`` base width (96 teacher, 24 student).
        algorithmically_approximate: ``True`` for a learned replacement of the reference codec.
        published_size / published_sha256: the published file to verify against (student only).
    """

    name: str
    base_dim: int
    description: str
    algorithmically_approximate: bool
    published_size: int | None = None
    published_sha256: str | None = None

    @property
    def feature_channels(self) -> tuple[int, ...]:
        return tuple(self.base_dim * m for m in (1, 2, 4))

    def diffusers_config(self) -> dict[str, Any]:
        """Keyword arguments of ``AutoencoderKLWan`` for this variant (diffusers defaults otherwise)."""
        return {"base_dim": self.base_dim, "z_dim": 16, "is_residual": False}


VARIANTS: Final[dict[str, CodecVariant]] = {
    TEACHER_VARIANT: CodecVariant(TEACHER_VARIANT, 96, "Wan2.1 VAE (teacher, base_dim 96)", False),
    STUDENT_VARIANT: CodecVariant(
        STUDENT_VARIANT, 24, "LightVAE Wan2.1 student (base_dim 24)", True,
        STUDENT_PUBLISHED_SIZE, STUDENT_PUBLISHED_SHA256,
    ),
}


def get_variant(name: str) -> CodecVariant:
    """The variant called ``name``.

    Raises:
        CheckpointError: unknown name (the message lists the known ones).
    """
    try:
        return VARIANTS[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"unknown Wan codec variant {name!r}; known variants: {', '.join(VARIANTS)}") from None


# --------------------------------------------------------------------------------------------- key tables

_RESNET_TO_ORIGINAL: Final = {
    "norm1.gamma": "residual.0.gamma",
    "conv1.weight": "residual.2.weight",
    "conv1.bias": "residual.2.bias",
    "norm2.gamma": "residual.3.gamma",
    "conv2.weight": "residual.6.weight",
    "conv2.bias": "residual.6.bias",
    "conv_shortcut.weight": "shortcut.weight",
    "conv_shortcut.bias": "shortcut.bias",
}
_FIXED_TO_ORIGINAL: Final = {
    "encoder.conv_in.": "encoder.conv1.",
    "decoder.conv_in.": "decoder.conv1.",
    "quant_conv.": "conv1.",
    "post_quant_conv.": "conv2.",
    "encoder.norm_out.": "encoder.head.0.",
    "encoder.conv_out.": "encoder.head.2.",
    "decoder.norm_out.": "decoder.head.0.",
    "decoder.conv_out.": "decoder.head.2.",
}


def original_key(diffusers_key: str, *, num_res_blocks: int = 2) -> str:
    """The original Wan layout name of a diffusers ``AutoencoderKLWan`` (``is_residual=False``) key.

    This is the inverse of diffusers' ``convert_wan_vae_to_diffusers``; :func:`original_key_table` checks it
    against that conversion.

    Raises:
        CheckpointError: the key belongs to no Wan2.1 VAE module.
    """
    for prefix, target in _FIXED_TO_ORIGINAL.items():
        if diffusers_key.startswith(prefix):
            return target + diffusers_key[len(prefix):]
    parts = diffusers_key.split(".")
    side = parts[0]
    if side in ("encoder", "decoder") and parts[1] == "mid_block":
        if parts[2] == "resnets":
            return f"{side}.middle.{2 * int(parts[3])}.{_RESNET_TO_ORIGINAL[_tail(parts, 4)]}"
        if parts[2] == "attentions":
            return f"{side}.middle.1.{_tail(parts, 4)}"
    if side == "encoder" and parts[1] == "down_blocks":
        suffix = _tail(parts, 3)
        return f"encoder.downsamples.{parts[2]}.{_RESNET_TO_ORIGINAL.get(suffix, suffix)}"
    if side == "decoder" and parts[1] == "up_blocks":
        stage, stride = int(parts[2]), num_res_blocks + 2
        if parts[3] == "resnets":
            return f"decoder.upsamples.{stage * stride + int(parts[4])}.{_RESNET_TO_ORIGINAL[_tail(parts, 5)]}"
        if parts[3] == "upsamplers":
            return f"decoder.upsamples.{stage * stride + num_res_blocks + 1}.{_tail(parts, 5)}"
    raise CheckpointError(f"{diffusers_key!r} is not a key of a Wan2.1 AutoencoderKLWan")


def _tail(parts: list[str], start: int) -> str:
    return ".".join(parts[start:])


@functools.lru_cache(maxsize=4)
def diffusers_shape_table(base_dim: int) -> Mapping[str, tuple[int, ...]]:
    """``{diffusers key: shape}`` of ``AutoencoderKLWan(base_dim=base_dim)`` (built on the meta device)."""
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        model = AutoencoderKLWan(base_dim=base_dim, z_dim=16, is_residual=False)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@functools.lru_cache(maxsize=4)
def original_key_table(base_dim: int) -> Mapping[str, tuple[int, ...]]:
    """``{original key: shape}`` expected in an original-layout file of the given width.

    Derived from diffusers' model through :func:`original_key` and verified against diffusers'
    ``convert_wan_vae_to_diffusers``: converting the table's keys must give back exactly the model's keys.

    Raises:
        CheckpointError: the installed diffusers disagrees with the inverse mapping or the key count
            differs from :data:`ORIGINAL_KEY_COUNT`.
    """
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    shapes = diffusers_shape_table(base_dim)
    table = {original_key(k): s for k, s in shapes.items()}
    round_trip = convert_wan_vae_to_diffusers({k: k for k in table})
    if set(round_trip) != set(shapes) or len(table) != len(shapes):
        missing = sorted(set(shapes) - set(round_trip))[:4]
        extra = sorted(set(round_trip) - set(shapes))[:4]
        raise CheckpointError(
            f"diffusers' convert_wan_vae_to_diffusers does not invert the Wan VAE key table "
            f"(missing {missing}, unexpected {extra}); this diffusers version is not supported"
        )
    for diffusers_name, original_name in round_trip.items():
        if original_key(diffusers_name) != original_name:
            raise CheckpointError(f"key conversion mismatch: {original_name!r} -> {diffusers_name!r}")
    if len(table) != ORIGINAL_KEY_COUNT:
        raise CheckpointError(
            f"AutoencoderKLWan(base_dim={base_dim}) has {len(table)} tensors, expected {ORIGINAL_KEY_COUNT}"
        )
    return table


def to_original_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a diffusers ``AutoencoderKLWan`` state dict to the original Wan layout (for writing files)."""
    return {original_key(k): v for k, v in state_dict.items()}


# --------------------------------------------------------------------------------------------- hashing


def parameter_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """SHA256 over names, dtypes, shapes and bytes of a state dict, in key order (device independent)."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach()
        digest.update(f"{name}|{tensor.dtype!s}|{list(tensor.shape)}\n".encode())
        digest.update(tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tensor_structure(state_dict: Mapping[str, torch.Tensor]) -> list[list[Any]]:
    """``[[name, [shape...], dtype], ...]`` in key order: the structure an artifact is bound to."""
    return [[k, list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in state_dict.items()]


# --------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class CodecSource:
    """Where codec weights came from (JSON-serialisable through :meth:`to_json`)."""

    path: str
    format: str  # original-pth | original-safetensors | diffusers-safetensors | diffusers-pth | diffusers-directory
    layout: str  # original | diffusers
    size_bytes: int
    mtime_ns: int
    tensor_count: int
    source_dtypes: tuple[str, ...]
    sha256: str | None = None
    published_checkpoint: bool | None = None
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "layout": self.layout,
            "size_bytes": self.size_bytes,
            "mtime_ns": self.mtime_ns,
            "tensor_count": self.tensor_count,
            "source_dtypes": list(self.source_dtypes),
            "sha256": self.sha256,
            "published_checkpoint": self.published_checkpoint,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class _RawCheckpoint:
    state_dict: dict[str, torch.Tensor]
    weights_file: Path
    format: str
    config: dict[str, Any] | None


def read_checkpoint(path: str | os.PathLike[str], *, component: str = "vae", recipe: str = "wan-video-codec") -> _RawCheckpoint:
    """Read a codec file or diffusers directory into a flat CPU state dict (no model is built).

    ``.pth``/``.pt``/``.ckpt``/``.bin`` go through ``torch.load(weights_only=True)`` only.

    Raises:
        MissingWeightsError: nothing exists at ``path`` (the message names it).
        CheckpointError: unreadable, not a flat mapping of tensors, or an unsupported file type.
    """
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        raise MissingWeightsError(recipe, component, [str(p)], hint="Pass the path of an existing Wan VAE checkpoint.")
    config: dict[str, Any] | None = None
    if p.is_dir():
        directory = p / "vae" if (p / "vae" / "config.json").is_file() else p
        weights = next((directory / n for n in DIFFUSERS_WEIGHT_FILES if (directory / n).is_file()), None)
        if weights is None or not (directory / "config.json").is_file():
            raise MissingWeightsError(
                recipe, component, [str(directory / n) for n in ("config.json", *DIFFUSERS_WEIGHT_FILES)],
                hint="A diffusers codec directory needs config.json and diffusion_pytorch_model.safetensors.",
            )
        from worldfoundry.core.model_loading.input_files import load_json_file

        try:
            config = load_json_file(directory / "config.json", what="codec config", max_bytes=1 << 20)
        except (OSError, ValueError) as exc:  # InputFileError / JsonInputError name the file and the key
            raise CheckpointError(f"{directory / 'config.json'}: unreadable codec config ({exc})") from exc
        if not isinstance(config, dict):
            raise CheckpointError(f"{directory / 'config.json'}: a codec config must be a JSON object")
        state_dict, fmt = _read_file(weights), "diffusers-directory"
        return _RawCheckpoint(state_dict, weights, fmt, config)
    state_dict = _read_file(p)
    fmt = "safetensors" if p.suffix == SAFETENSORS_SUFFIX else "pth"
    return _RawCheckpoint(state_dict, p, fmt, None)


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    from worldfoundry.core.model_loading.input_files import check_input_file
    from worldfoundry.errors import InputFileError

    try:  # stat before reading: a regular file within the bound (never a FIFO or a device such as /dev/zero)
        check_input_file(path, what="codec checkpoint", max_bytes=MAX_CODEC_FILE_BYTES)
    except InputFileError as exc:
        raise CheckpointError(str(exc)) from exc
    if path.suffix == SAFETENSORS_SUFFIX:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path), device="cpu"))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    if path.suffix not in ORIGINAL_SUFFIXES:
        raise CheckpointError(
            f"{path}: unsupported codec file type {path.suffix!r}; use one of "
            f"{', '.join((*ORIGINAL_SUFFIXES, SAFETENSORS_SUFFIX))} or a diffusers directory"
        )
    try:
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ... for bad files
        raise CheckpointError(
            f"{path}: cannot be read with torch.load(weights_only=True) ({type(exc).__name__}: {exc}); "
            "only plain tensor checkpoints are accepted"
        ) from exc
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"{path}: expected a state dict (mapping of names to tensors), got {type(loaded).__name__}")
    bad = [k for k, v in loaded.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(
            f"{path}: not a flat state dict of tensors (entry {bad[0]!r} is a {type(loaded[bad[0]]).__name__}); "
            "save the VAE's state_dict() itself"
        )
    return dict(loaded)


# --------------------------------------------------------------------------------------------- identification


@dataclass(frozen=True)
class CodecIdentity:
    """What a state dict is, read from a few characteristic tensors."""

    layout: str
    base_dim: int | None
    z_dim: int | None
    in_channels: int | None

    def describe(self) -> str:
        if self.z_dim == 48 or self.in_channels == 12:
            return f"a Wan2.2 VAE ({self.z_dim} latent channels, base_dim {self.base_dim})"
        for variant in VARIANTS.values():
            if self.base_dim == variant.base_dim and self.z_dim == 16:
                return f"a {variant.description} checkpoint"
        return f"an unrecognised VAE (base_dim {self.base_dim}, {self.z_dim} latent channels)"

    def matches(self, variant: CodecVariant) -> bool:
        return self.base_dim == variant.base_dim and self.z_dim == 16 and self.in_channels == 3


_LAYOUT_KEYS: Final = {
    "original": ("encoder.conv1.weight", "conv2.weight", "decoder.conv1.weight"),
    "diffusers": ("encoder.conv_in.weight", "post_quant_conv.weight", "decoder.conv_in.weight"),
}


def identify(state_dict: Mapping[str, torch.Tensor], *, where: str = "checkpoint") -> CodecIdentity:
    """Layout, width and latent channels of a Wan VAE state dict.

    Raises:
        CheckpointError: neither Wan VAE layout's input convolution is present.
    """
    for layout, (enc_in, post_quant, dec_in) in _LAYOUT_KEYS.items():
        if enc_in in state_dict:
            enc = state_dict[enc_in]
            base = int(enc.shape[0]) if enc.ndim == 5 else None
            in_ch = int(enc.shape[1]) if enc.ndim == 5 else None
            if post_quant in state_dict:
                z_dim: int | None = int(state_dict[post_quant].shape[0])
            elif dec_in in state_dict:
                z_dim = int(state_dict[dec_in].shape[1])
            else:
                z_dim = None
            return CodecIdentity(layout, base, z_dim, in_ch)
    raise CheckpointError(
        f"{where}: not a Wan VAE state dict (neither 'encoder.conv1.weight' nor 'encoder.conv_in.weight' found; "
        f"first keys: {list(state_dict)[:3]})"
    )


def check_and_convert(state_dict: Mapping[str, torch.Tensor], variant: CodecVariant, *,
                      where: str) -> tuple[dict[str, torch.Tensor], CodecIdentity]:
    """Strictly check a state dict against ``variant`` and return it in diffusers naming.

    Every expected key must be present with its shape and nothing else may be there.

    Raises:
        CheckpointError: the file is another codec (message says which), or keys/shapes differ.
        NonFiniteWeightsError: a tensor holds NaN or Inf (a :class:`CheckpointError` naming the key).
    """
    identity = identify(state_dict, where=where)
    if not identity.matches(variant):
        hint = ""
        other = next((v for v in VARIANTS.values() if identity.matches(v)), None)
        if other is not None:
            hint = f"; load it with variant={other.name!r}"
        raise CheckpointError(f"{where} is {identity.describe()}, not the {variant.description}{hint}")
    expected = original_key_table(variant.base_dim) if identity.layout == "original" else diffusers_shape_table(variant.base_dim)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = sorted(
        f"{k}: {tuple(state_dict[k].shape)} != {expected[k]}"
        for k in set(expected) & set(state_dict)
        if tuple(state_dict[k].shape) != expected[k]
    )
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s) (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s) (e.g. {unexpected[:3]})")
        if wrong:
            parts.append(f"{len(wrong)} shape mismatch(es) (e.g. {wrong[:3]})")
        raise CheckpointError(
            f"{where} does not match the {variant.description} ({len(expected)} {identity.layout}-layout tensors "
            f"expected): " + "; ".join(parts)
        )
    bad_dtype = sorted(k for k, v in state_dict.items() if not v.is_floating_point())
    if bad_dtype:
        raise CheckpointError(f"{where}: non-floating tensors {bad_dtype[:3]} in a codec checkpoint")
    from worldfoundry.core.model_loading.input_files import check_finite_tensors

    check_finite_tensors(state_dict, where=where)  # NonFiniteWeightsError names the tensor
    if identity.layout == "original":
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

        converted = convert_wan_vae_to_diffusers(dict(state_dict))
    else:
        converted = dict(state_dict)
    return converted, identity


def check_diffusers_config(config: Mapping[str, Any], variant: CodecVariant, *, where: str) -> None:
    """Refuse a diffusers ``config.json`` that describes another codec than ``variant``.

    Raises:
        CheckpointError: a field differs (named in the message).
    """
    from diffusers import AutoencoderKLWan

    defaults = dict(diffusers_default_config())
    defaults.update(variant.diffusers_config())
    if config.get("_class_name", "AutoencoderKLWan") != AutoencoderKLWan.__name__:
        raise CheckpointError(f"{where}: config is for {config.get('_class_name')!r}, not AutoencoderKLWan")
    differing = []
    for key, value in defaults.items():
        if key in config and config[key] is not None and config[key] != value:
            differing.append(f"{key}={config[key]!r} (expected {value!r})")
    if differing:
        raise CheckpointError(f"{where}: config does not describe the {variant.description}: {', '.join(differing)}")


@functools.lru_cache(maxsize=1)
def diffusers_default_config() -> Mapping[str, Any]:
    """The architecture fields of diffusers' default ``AutoencoderKLWan`` config (Wan16 mean/std included)."""
    import inspect

    from diffusers import AutoencoderKLWan

    params = inspect.signature(AutoencoderKLWan.__init__).parameters
    keys = ("z_dim", "dim_mult", "num_res_blocks", "temperal_downsample", "is_residual", "in_channels",
            "out_channels", "patch_size", "latents_mean", "latents_std")
    return {k: params[k].default for k in keys}


def describe_source(raw: _RawCheckpoint, identity: CodecIdentity, *, sha256: str | None,
                    published: bool | None, notes: tuple[str, ...]) -> CodecSource:
    """Build the :class:`CodecSource` record of a checked checkpoint."""
    stat = raw.weights_file.stat()
    layout_format = f"{identity.layout}-{'safetensors' if raw.weights_file.suffix == SAFETENSORS_SUFFIX else 'pth'}"
    dtypes = tuple(sorted({str(v.dtype).removeprefix("torch.") for v in raw.state_dict.values()}))
    return CodecSource(
        path=str(raw.weights_file),
        format="diffusers-directory" if raw.format == "diffusers-directory" else layout_format,
        layout=identity.layout,
        size_bytes=stat.st_size,
        mtime_ns=stat.st_mtime_ns,
        tensor_count=len(raw.state_dict),
        source_dtypes=dtypes,
        sha256=sha256,
        published_checkpoint=published,
        notes=notes,
    )


__all__ = [
    "ORIGINAL_KEY_COUNT",
    "STUDENT_PUBLISHED_SHA256",
    "STUDENT_PUBLISHED_SIZE",
    "STUDENT_VARIANT",
    "TEACHER_VARIANT",
    "VARIANTS",
    "CodecIdentity",
    "CodecSource",
    "CodecVariant",
    "check_and_convert",
    "check_diffusers_config",
    "diffusers_shape_table",
    "file_sha256",
    "get_variant",
    "identify",
    "original_key",
    "original_key_table",
    "parameter_sha256",
    "read_checkpoint",
    "tensor_structure",
    "to_original_state_dict",
]
