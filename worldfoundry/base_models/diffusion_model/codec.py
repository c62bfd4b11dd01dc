"""The Wan2.1 video codec: teacher (Wan2.1 VAE) or LightVAE student, built on diffusers ``AutoencoderKLWan``.

:func:`load_wan_video_codec` reads a checkpoint strictly (see :mod:`.codec_checkpoints`), builds the
diffusers model in float32 on one device and returns a :class:`WanVideoCodec`:
``encode(video) -> normalized latents`` and ``decode(latents) -> video in [-1, 1]``, both BCTHW and
normalized with the Wan16 ``latents_mean``/``latents_std`` exactly as diffusers' Wan pipelines do.

The student is a different learned codec, so its reports always say ``algorithmically_approximate: true``.
Going back to the teacher means loading the codec again with teacher weights.

Example:
    >>> codec = load_wan_video_codec("lightvaew2_1.pth", variant="lightvae-wan21", device="cuda")  # doctest: +SKIP
    >>> latents = codec.encode(video)          # (1, 16, 21, 60, 104) for an 81×480×832 video  # doctest: +SKIP
    >>> frames = codec.decode(latents)         # (1, 3, 81, 480, 832) in [-1, 1]  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import torch

from worldfoundry.base_models.diffusion_model.codec_checkpoints import (
    STUDENT_VARIANT,
    TEACHER_VARIANT,
    CodecSource,
    CodecVariant,
    check_and_convert,
    check_diffusers_config,
    describe_source,
    file_sha256,
    get_variant,
    read_checkpoint,
)
from worldfoundry.base_models.diffusion_model.codec_options import (  # FP8_BACKENDS: re-exported
    FP8_BACKENDS,
    REFUSED_OPTIONS,
    check_load_arguments,
    check_purpose_and_dtype,
    refuse_codec_options,
)
from worldfoundry.core.model_loading.policy import (
    RuntimePolicy,
    dtype_name,
    parse_device,
)
from worldfoundry.errors import (
    ArtifactMismatchError,
    CheckpointError,
    InvalidRequestError,
    ModelBusyError,
    UnsupportedCodecOptionError,
)

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan

    from worldfoundry.core.acceleration.registry import AccelerationRegistry
    from worldfoundry.core.acceleration.session import AccelerationSession

logger = logging.getLogger(__name__)

#: Name of the acceleration plugin that runs the student encoder in FP8 (distribution ``worldfoundry-lightvae``).
FP8_PLUGIN_NAME: Final = "lightvae"


class WanVideoCodec:
    """A loaded Wan2.1 codec (teacher or LightVAE student) around a diffusers ``AutoencoderKLWan``.

    Attributes:
        module: the diffusers model (float32, eval, no gradients).
        variant: the :class:`~.codec_checkpoints.CodecVariant`.
        source: where the weights came from (``None`` for random weights).
        fp8_session: the FP8 encoder acceleration session when a calibration artifact was given.
        calls / frames: execution counters.
    """

    def __init__(self, module: AutoencoderKLWan, variant: CodecVariant, *, source: CodecSource | None = None,
                 random_seed: int | None = None) -> None:
        self.module = module
        self.variant = variant
        self.source = source
        self.random_seed = random_seed
        self.tiled = False
        self.fp8_session: AccelerationSession | None = None
        self.calls = {"encode": 0, "decode": 0}
        self.frames = {"encoded": 0, "decoded": 0}
        self.last_shapes: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        cfg = module.config
        self.z_dim = int(cfg.z_dim)
        self.temporal_stride = int(cfg.scale_factor_temporal)
        self.spatial_stride = int(cfg.scale_factor_spatial)
        # The same expressions as diffusers' WanPipeline (mean and reciprocal std in float32).
        self._latents_mean = torch.tensor(cfg.latents_mean).view(1, self.z_dim, 1, 1, 1).to(self.device, self.dtype)
        self._latents_inv_std = (1.0 / torch.tensor(cfg.latents_std).view(1, self.z_dim, 1, 1, 1)).to(
            self.device, self.dtype
        )

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    @property
    def algorithmically_approximate(self) -> bool:
        return self.variant.algorithmically_approximate

    # ------------------------------------------------------------------ normalization
    def normalize(self, raw_latents: torch.Tensor) -> torch.Tensor:
        """Raw VAE latents -> the normalized latents the DiT sees: ``(z - mean) * (1 / std)``."""
        return (raw_latents - self._latents_mean) * self._latents_inv_std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents -> raw VAE latents: ``z / (1 / std) + mean`` (as ``WanPipeline`` decodes)."""
        return latents / self._latents_inv_std + self._latents_mean

    # ------------------------------------------------------------------ calls
    def _check_runtime(self, action: str) -> None:
        if torch.is_autocast_enabled(self.device.type):
            raise UnsupportedCodecOptionError(
                "autocast", f"cannot {action} under torch.autocast; the codec runs in float32 (leave the autocast block)"
            )

    def _acquire(self, action: str) -> None:
        if not self._lock.acquire(blocking=False):
            raise ModelBusyError(f"{action} with the video codec", (), 1)

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """BCTHW video in [-1, 1] -> normalized latents (the posterior mode), float32 on the codec device.

        Raises:
            InvalidRequestError: not ``(B, 3, 1 + 4k, 8h, 8w)``.
            UnsupportedCodecOptionError: called under autocast.
            ModelBusyError: another call is running on this codec.
        """
        if video.ndim != 5 or video.shape[1] != 3 or not video.is_floating_point():
            raise InvalidRequestError(f"encode expects a floating (B, 3, T, H, W) video, got {tuple(video.shape)} {video.dtype}")
        t, h, w = video.shape[2:]
        if (t - 1) % self.temporal_stride or h % self.spatial_stride or w % self.spatial_stride:
            raise InvalidRequestError(
                f"encode expects T = 1 + {self.temporal_stride}k frames and H, W multiples of {self.spatial_stride}; "
                f"got T={t}, H={h}, W={w}"
            )
        self._check_runtime("encode")
        self._acquire("encode")
        try:
            with torch.no_grad():
                try:
                    raw = self.module.encode(video.to(self.device, self.dtype)).latent_dist.mode()
                finally:
                    self.module.clear_cache()
                latents = self.normalize(raw)
            self.calls["encode"] += 1
            self.frames["encoded"] += int(t) * int(video.shape[0])
            self.last_shapes["encode"] = list(latents.shape)
            return latents
        finally:
            self._lock.release()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized BCTHW latents -> video in [-1, 1] (float32, ``1 + 4(T - 1)`` frames).

        Raises:
            InvalidRequestError: not ``(B, 16, T, h, w)``.
            UnsupportedCodecOptionError: called under autocast.
            ModelBusyError: another call is running on this codec.
        """
        if latents.ndim != 5 or latents.shape[1] != self.z_dim or not latents.is_floating_point():
            raise InvalidRequestError(
                f"decode expects floating (B, {self.z_dim}, T, h, w) latents, got {tuple(latents.shape)} {latents.dtype}"
            )
        self._check_runtime("decode")
        self._acquire("decode")
        try:
            with torch.no_grad():
                raw = self.denormalize(latents.to(self.device, self.dtype))
                try:
                    video = self.module.decode(raw, return_dict=False)[0]
                finally:
                    self.module.clear_cache()
            self.calls["decode"] += 1
            self.frames["decoded"] += int(video.shape[2]) * int(video.shape[0])
            self.last_shapes["decode"] = list(video.shape)
            return video
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ reports
    def execution_report(self) -> dict[str, Any]:
        """JSON-serialisable report: variant, exactness, provenance, counters and the FP8 session (if any)."""
        fp8: dict[str, Any] | None = None
        if self.fp8_session is not None:
            fp8 = {
                "installed": self.fp8_session.receipt.to_json(),
                "execution": self.fp8_session.execution_report(),
            }
        return {
            "variant": self.variant.name,
            "description": self.variant.description,
            "algorithmically_approximate": self.variant.algorithmically_approximate,
            "base_dim": self.variant.base_dim,
            "feature_channels": list(self.variant.feature_channels),
            "z_dim": self.z_dim,
            "dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "tiled": False,
            "source": self.source.to_json() if self.source is not None else None,
            "random_weights": self.source is None,
            "random_seed": self.random_seed,
            "calls": dict(self.calls),
            "frames": dict(self.frames),
            "last_shapes": {k: list(v) for k, v in self.last_shapes.items()},
            "fp8_encoder": fp8,
        }

    def close(self) -> None:
        """Uninstall the FP8 encoder session (exact restore of the encoder), if any. Idempotent.

        Raises:
            ModelBusyError: a request is active on the encoder (the session stays installed).
        """
        if self.fp8_session is not None:
            self.fp8_session.uninstall()
            self.fp8_session = None

    def __repr__(self) -> str:
        return f"WanVideoCodec({self.variant.name!r}, device={self.device}, fp8={self.fp8_session is not None})"


# --------------------------------------------------------------------------------------------- building


def _build_module(variant: CodecVariant, state_dict: Mapping[str, torch.Tensor] | None, device: torch.device,
                  seed: int | None) -> AutoencoderKLWan:
    from diffusers import AutoencoderKLWan

    if state_dict is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0 if seed is None else seed)
            module = AutoencoderKLWan(**variant.diffusers_config())
    else:
        with torch.device("meta"):
            module = AutoencoderKLWan(**variant.diffusers_config())
        tensors = {k: v.to(torch.float32).contiguous() for k, v in state_dict.items()}
        module.load_state_dict(tensors, strict=True, assign=True)
    module.requires_grad_(False)
    module.eval()
    return module.to(device)


def random_wan_video_codec(variant: str = STUDENT_VARIANT, *, device: Any = "cpu", seed: int = 0) -> WanVideoCodec:
    """A codec with diffusers' default initialization under ``seed`` (no file; quality numbers are meaningless)."""
    spec = get_variant(variant)
    module = _build_module(spec, None, parse_device(device), seed)
    return WanVideoCodec(module, spec, source=None, random_seed=seed)


def _read_codec_source(path: str | os.PathLike[str], spec: CodecVariant, published_size: int | None,
                       published_sha256: str | None, *, need_sha: bool) -> tuple[dict[str, torch.Tensor], CodecSource]:
    """Read, check and convert the codec checkpoint at ``path``, and describe where it came from.

    Args:
        need_sha: hash the weights file even when it is not the published one (an FP8 artifact is bound to it).

    Returns:
        ``(converted float32 state dict, source)``.

    Raises:
        MissingWeightsError / CheckpointError: as :func:`load_wan_video_codec`.
    """
    raw = read_checkpoint(path, recipe=spec.name)
    where = str(raw.weights_file)
    state_dict, identity = check_and_convert(raw.state_dict, spec, where=where)
    if raw.config is not None:
        check_diffusers_config(raw.config, spec, where=where)
    sha, published, notes = _verify_published(raw.weights_file, spec, published_size, published_sha256)
    if need_sha and sha is None:
        sha = file_sha256(raw.weights_file)
    dtypes = {str(v.dtype) for v in raw.state_dict.values()}
    if dtypes != {"torch.float32"}:
        notes += (f"source tensors {sorted(dtypes)} upcast to float32",)
    return state_dict, describe_source(raw, identity, sha256=sha, published=published, notes=notes)


def load_wan_video_codec(
    path: str | os.PathLike[str] | None,
    variant: str = TEACHER_VARIANT,
    device: Any = "cuda",
    dtype: Any = torch.float32,
    fp8_calibration: str | os.PathLike[str] | None = None,
    *,
    fp8_backend: str = "auto",
    purpose: str = "inference",
    published_size: int | None = None,
    published_sha256: str | None = None,
    seed: int | None = None,
    registry: AccelerationRegistry | None = None,
    **refused_options: Any,
) -> WanVideoCodec:
    """Load a Wan2.1 codec strictly and return a :class:`WanVideoCodec` (float32, resident on ``device``).

    Args:
        path: original-layout ``.pth``/``.safetensors`` file, diffusers-layout file or diffusers directory;
            ``None`` builds seeded random weights (``seed``).
        variant: ``"wan2.1"`` (teacher, base_dim 96) or ``"lightvae-wan21"`` (student, base_dim 24).
        device: where the codec runs (CPU or CUDA).
        dtype: must be float32.
        fp8_calibration: calibration artifact for the FP8 student encoder (runtime name ``vae_fp8_calibration``);
            installs the ``lightvae`` acceleration on ``codec.module.encoder``.
        fp8_backend: ``"auto"`` (FP8 GEMM on CUDA sm_89+, visible dense fallback elsewhere), ``"scaled_mm"``
            or ``"reference"`` (dequantized torch reference).
        purpose: only ``"inference"``.
        published_size / published_sha256: the published student file to verify (defaults to the real one).
        seed: seed for random weights when ``path`` is ``None``.
        registry: where the ``lightvae`` acceleration is looked up (the process default when ``None``).
        **refused_options: tiling, temporal chunking, parallel decode, offload, quantization, compile, graphs,
            SP, autocast — accepted only when switched off.

    Returns:
        The loaded :class:`WanVideoCodec`.

    Raises:
        UnsupportedCodecOptionError: a refused option (named), a non-float32 dtype, or FP8 with the teacher.
        MissingWeightsError: ``path`` does not exist (named).
        CheckpointError: wrong codec (teacher given as student, Wan2.2, ...), missing/unexpected keys or
            shapes, or a published-size file whose SHA256 differs.
        ArtifactMismatchError: the FP8 artifact belongs to other weights or geometry (nothing was changed).
    """
    spec, target = check_load_arguments(variant, device, dtype, fp8_calibration, fp8_backend, purpose,
                                        refused_options)
    state_dict, source = _read_optional_source(path, spec, published_size, published_sha256, fp8_calibration)
    module = _build_module(spec, state_dict, target, seed)
    del state_dict
    random_seed = (0 if seed is None else seed) if path is None else None
    codec = WanVideoCodec(module, spec, source=source, random_seed=random_seed)
    if fp8_calibration is not None:
        codec.fp8_session = install_fp8_encoder(codec, fp8_calibration, backend=fp8_backend, registry=registry)
    logger.info("loaded %s codec on %s from %s", spec.name, target, source.path if source else "random weights")
    return codec


def _read_optional_source(path: str | os.PathLike[str] | None, spec: CodecVariant, published_size: int | None,
                          published_sha256: str | None, fp8_calibration: str | os.PathLike[str] | None
                          ) -> tuple[dict[str, torch.Tensor] | None, CodecSource | None]:
    """The checked state dict and source of ``path`` (``(None, None)`` for random weights); an FP8 artifact
    is checked against that source before anything is built."""
    source: CodecSource | None = None
    state_dict: dict[str, torch.Tensor] | None = None
    if path is not None:
        state_dict, source = _read_codec_source(path, spec, published_size, published_sha256,
                                                need_sha=fp8_calibration is not None)
    if fp8_calibration is not None:
        _early_artifact_check(fp8_calibration, source)
    return state_dict, source


def _verify_published(weights_file: Any, spec: CodecVariant, size: int | None,
                      sha256: str | None) -> tuple[str | None, bool | None, tuple[str, ...]]:
    """Hash the file once when it has the published size; a different hash is an error."""
    expected_size = size if size is not None else spec.published_size
    expected_sha = sha256 if sha256 is not None else spec.published_sha256
    if expected_size is None or expected_sha is None:
        return None, None, ()
    actual_size = os.path.getsize(weights_file)
    if actual_size != expected_size:
        return None, None, (f"size {actual_size} differs from the published {expected_size}; hash not verified",)
    digest = file_sha256(weights_file)
    if digest != expected_sha:
        raise CheckpointError(
            f"{weights_file} has the published {spec.description} size ({expected_size} bytes) but SHA256 {digest}, "
            f"expected {expected_sha}: the file is corrupt or modified; download it again"
        )
    return digest, True, (f"SHA256 verified against the published {spec.description}",)


def _early_artifact_check(artifact_path: str | os.PathLike[str], source: CodecSource | None) -> None:
    """Refuse an artifact bound to another checkpoint file before any model is built."""
    from worldfoundry.base_models.diffusion_model.codec_fp8 import load_artifact

    artifact = load_artifact(artifact_path)
    recorded = artifact["checkpoint"].get("sha256")
    actual = source.sha256 if source is not None else None
    if recorded is not None and actual is not None and recorded != actual:
        raise ArtifactMismatchError(
            f"{artifact_path} was calibrated on checkpoint SHA256 {recorded}, but {source.path if source else '?'} "
            f"has SHA256 {actual}; calibrate again for this checkpoint"
        )


def install_fp8_encoder(codec: WanVideoCodec, artifact_path: str | os.PathLike[str], *, backend: str = "auto",
                        count_clipping: bool = True, registry: AccelerationRegistry | None = None) -> AccelerationSession:
    """Install the ``lightvae`` FP8 acceleration on ``codec.module.encoder`` (validated before any change).

    Args:
        codec: a student codec without an FP8 session.
        artifact_path: the calibration artifact.
        backend: ``"auto"``, ``"scaled_mm"`` or ``"reference"``.
        count_clipping: count inputs beyond the calibrated range (a diagnostic with a small cost).
        registry: where ``lightvae`` is looked up (the process default when ``None``).

    Returns:
        The session (also attached to the encoder); ``codec.close()`` uninstalls it when stored in
        ``codec.fp8_session``.

    Raises:
        UnknownAccelerationError: the ``worldfoundry-lightvae`` distribution is not installed.
        ArtifactMismatchError / AccelerationRefusedError: from the plugin's prepare step.
    """
    from worldfoundry.core.acceleration.installer import install_diffusion_accelerations

    options: dict[str, Any] = {"calibration": os.fspath(artifact_path), "backend": backend,
                               "count_clipping": count_clipping}
    if codec.source is not None and codec.source.sha256 is not None:
        options["checkpoint_sha256"] = codec.source.sha256
    policy = RuntimePolicy(device=codec.device, dtype=torch.float32)
    return install_diffusion_accelerations(codec.module.encoder, {FP8_PLUGIN_NAME: options}, policy, registry=registry)


# --------------------------------------------------------------------------------------------- component options

COMPONENT_OPTION_KEYS: Final = frozenset(
    {"variant", "tiled", "dtype", "vae_dtype", "fp8_calibration", "vae_fp8_calibration", "fp8_backend", "seed"}
)


def codec_from_component_options(
    path: str | os.PathLike[str] | None,
    options: Mapping[str, Any],
    device: Any,
    *,
    recipe_default_tiled: bool = False,
    runtime_options: Mapping[str, Any] | None = None,
    registry: AccelerationRegistry | None = None,
) -> WanVideoCodec:
    """Build the codec a pipeline's ``component_options={"latent_encoder:codec": {...}}`` ask for.

    Component options override runtime options of the same name (``vae_dtype``, ``vae_fp8_calibration``).

    Args:
        path: the ``checkpoint_overrides`` path (``"vae"`` for Wan recipes, ``"codec"`` for SANA-Video), or
            ``None`` for seeded random weights.
        options: ``variant``, ``tiled``, ``dtype``/``vae_dtype``, ``fp8_calibration``/``vae_fp8_calibration``,
            ``fp8_backend``, ``seed``; refused options (tiling, offload, ...) are refused by name.
        device: the pipeline device.
        recipe_default_tiled: the recipe's codec is tiled by default (SANA-Video): selecting the student then
            requires an explicit ``tiled: False``.
        runtime_options: the runtime policy's options.

    Raises:
        UnsupportedCodecOptionError: the student selected on a tiled-by-default recipe without ``tiled: False``,
            FP8 calibration without the student, or any refused/unknown option.
    """
    opts = dict(options)
    runtime = dict(runtime_options or {})
    variant = opts.pop("variant", TEACHER_VARIANT)
    if variant == STUDENT_VARIANT and recipe_default_tiled and opts.get("tiled", True) is not False:
        raise UnsupportedCodecOptionError(
            "tiled", f"this recipe defaults to a tiled codec; selecting variant {STUDENT_VARIANT!r} requires "
            "'tiled': False in the codec component options (the student runs untiled)"
        )
    tiled = opts.pop("tiled", False)
    dtype, vae_dtype = opts.pop("dtype", None), opts.pop("vae_dtype", None)
    if dtype is None:
        dtype = vae_dtype if vae_dtype is not None else (runtime.get("vae_dtype") or torch.float32)
    calibration, vae_calibration = opts.pop("fp8_calibration", None), opts.pop("vae_fp8_calibration", None)
    if calibration is None:
        calibration = vae_calibration if vae_calibration is not None else runtime.get("vae_fp8_calibration")
    if calibration is not None and variant != STUDENT_VARIANT:
        raise UnsupportedCodecOptionError(
            "vae_fp8_calibration", f"requires variant={STUDENT_VARIANT!r} in the codec component options, got {variant!r}"
        )
    backend = opts.pop("fp8_backend", "auto")
    seed = opts.pop("seed", None)
    return load_wan_video_codec(path, variant, device, dtype, calibration, fp8_backend=backend, seed=seed,
                                registry=registry, tiled=tiled, **opts)


__all__ = [
    "COMPONENT_OPTION_KEYS",
    "FP8_PLUGIN_NAME",
    "REFUSED_OPTIONS",
    "WanVideoCodec",
    "codec_from_component_options",
    "install_fp8_encoder",
    "load_wan_video_codec",
    "random_wan_video_codec",
    "refuse_codec_options",
]
