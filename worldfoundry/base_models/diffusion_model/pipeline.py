"""``NativeDiffusionPipeline``: recipe -> components -> accelerations -> ``generate(request)``.

Example:
    >>> import torch
    >>> from worldfoundry.core.model_loading.policy import RuntimePolicy
    >>> from worldfoundry.base_models.diffusion_model.pipeline import NativeDiffusionPipeline, DiffusionRequest
    >>> with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=RuntimePolicy()) as pipe:
    ...     result = pipe.generate(DiffusionRequest(prompt="a red ball", num_frames=5, height=32, width=32,
    ...                                             num_inference_steps=2, seed=42, request_id="r1"))
    >>> tuple(result.latents.shape)
    (1, 16, 2, 4, 4)
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from worldfoundry.base_models.diffusion_model.denoiser import Denoiser
from worldfoundry.base_models.diffusion_model.drivers import driver_for
from worldfoundry.base_models.diffusion_model.patch_codec import PixelPatchCodec
from worldfoundry.base_models.diffusion_model.request import DiffusionRequest, DiffusionResult
from worldfoundry.base_models.diffusion_model.runner import NativeRunner
from worldfoundry.base_models.diffusion_model.vae_codec import VaeLatentCodec, video_to_uint8
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.loader import LoadedComponents, load_components, split_component_options
from worldfoundry.core.model_loading.policy import RuntimePolicy, normalize_acceleration_spec
from worldfoundry.core.model_loading.recipes import Recipe, available_recipes, load_recipe
from worldfoundry.errors import (
    AccelerationInstallError,
    InvalidRequestError,
    PipelineClosedError,
    UnknownRecipeError,
)

logger = logging.getLogger(__name__)

__all__ = ["DiffusionRequest", "DiffusionResult", "NativeDiffusionPipeline", "PipelineComponents"]


@dataclass
class PipelineComponents:
    recipe: Recipe
    denoiser: Denoiser
    scheduler: Any
    tokenizer: Any = None
    text_encoder: Any = None
    image_encoder: Any = None
    image_processor: Any = None
    codec: Any = None
    sources: list[Any] = field(default_factory=list)
    random_weights: bool = False

    def weight_report(self) -> dict[str, Any]:
        return {"random_weights": self.random_weights, "sources": [s.to_json() for s in self.sources]}


def resolve_recipe(recipe_or_dir: str | os.PathLike[str]) -> tuple[Recipe, str | None]:
    """A recipe name/YAML path, or a diffusers directory whose transformer config matches a known recipe."""
    path = Path(os.fspath(recipe_or_dir))
    if not path.is_dir():
        return load_recipe(recipe_or_dir), None
    config_file = path / "transformer" / "config.json"
    if not config_file.is_file():
        raise UnknownRecipeError(str(recipe_or_dir), available_recipes())
    from worldfoundry.core.model_loading.input_files import load_json_file

    config = load_json_file(config_file, what="transformer config")
    if not isinstance(config, dict):
        raise UnknownRecipeError(f"{recipe_or_dir} ({config_file} is not a JSON object)", available_recipes())
    keys = ("num_layers", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels")
    for name in available_recipes():
        recipe = load_recipe(name)
        den = recipe.denoiser
        if den.class_path and den.class_path.rsplit(".", 1)[-1] == config.get("_class_name") and all(
            den.config.get(k) == config.get(k) for k in keys if k in config
        ):
            return recipe, str(path)
    raise UnknownRecipeError(f"{recipe_or_dir} (no recipe matches its transformer config)", available_recipes())


def build_codec(loaded: LoadedComponents, policy: RuntimePolicy) -> Any:
    """The recipe's codec, or the variant ``component_options`` select (e.g. ``lightvae-wan21``)."""
    options = dict(loaded.codec_options)
    if loaded.codec_module is None and options.get("variant", "wan2.1") != "wan2.1":
        from worldfoundry.base_models.diffusion_model.codec import codec_from_component_options

        default_tiled, path = options.pop("recipe_default_tiled"), options.pop("path")
        return codec_from_component_options(path, options, policy.device, recipe_default_tiled=default_tiled,
                                            runtime_options=dict(policy.options))
    if loaded.codec_module is None:
        return None
    if isinstance(loaded.codec_module, PixelPatchCodec):
        return loaded.codec_module
    source = next((s for s in loaded.sources if s.component == "codec"), None)
    report = {"weights": source.to_json() if source else None}
    return VaeLatentCodec(loaded.codec_module, tiled=bool(options.get("tiled", False)), report=report)


class NativeDiffusionPipeline:
    """Loads a recipe and runs requests through the native runner. Use as a context manager or call
    :meth:`close`, which waits for the device, uninstalls accelerations and drops every weight."""

    def __init__(self, components: PipelineComponents, policy: RuntimePolicy) -> None:
        self.components = components
        self.policy = policy
        self._runner = NativeRunner(components.denoiser, driver_for(components), components.scheduler,
                                    device=policy.device, dtype=policy.dtype)
        self._closed = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        recipe_or_dir: str | os.PathLike[str],
        policy: RuntimePolicy | None = None,
        accelerations: Mapping[str, Any] | None = None,
        checkpoint_overrides: Mapping[str, Any] | None = None,
        component_options: Mapping[str, Any] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        *,
        random_weights: bool = False,
        registry: AccelerationRegistry | None = None,
    ) -> NativeDiffusionPipeline:
        """Build a pipeline.

        Args:
            recipe_or_dir: recipe name (``"tiny-wan2.1"``), recipe YAML path, or a diffusers directory.
            policy: device/dtype/options (CPU float32 by default).
            accelerations: ``{name: options}``; overrides ``policy.options["accelerations"]``.
            checkpoint_overrides: single files per component (``{"transformer": "wan.safetensors",
                "vae": "Wan2.1_VAE.pth"}``).
            component_options: per-component options (``{"latent_encoder:codec": {"tiled": False}}``); they
                override runtime options of the same name.
            checkpoint_dir: a local diffusers-format directory.
            random_weights: build a real recipe with seeded random weights (reports say so).
            registry: acceleration registry (the process default when ``None``).

        Raises:
            UnknownRecipeError, MissingWeightsError, CheckpointError, AccelerationInstallError, ...
        """
        policy = policy or RuntimePolicy()
        recipe, inferred_dir = resolve_recipe(recipe_or_dir)
        if recipe.component("codec") is not None:  # fail before loading anything
            from worldfoundry.base_models.diffusion_model.codec_options import refuse_calibration_for_recipe_codec

            codec_options = split_component_options(component_options).get("codec", {})
            refuse_calibration_for_recipe_codec(codec_options, policy.options)
        loaded = load_components(recipe, policy, checkpoint_dir=checkpoint_dir or inferred_dir,
                                 checkpoint_overrides=checkpoint_overrides, component_options=component_options,
                                 random_weights=random_weights)
        denoiser = Denoiser(loaded.experts, boundary_ratio=recipe.boundary_ratio, name=recipe.name)
        components = PipelineComponents(
            recipe=recipe, denoiser=denoiser, scheduler=loaded.scheduler, tokenizer=loaded.tokenizer,
            text_encoder=loaded.text_encoder, image_encoder=loaded.image_encoder,
            image_processor=loaded.image_processor, codec=build_codec(loaded, policy), sources=list(loaded.sources),
            random_weights=loaded.random_weights,
        )
        pipe = cls(components, policy)
        spec = normalize_acceleration_spec(accelerations if accelerations is not None else policy.accelerations)
        if spec:
            try:
                denoiser.install(spec, policy, registry=registry)
            except BaseException:
                pipe.close()
                raise
            session = denoiser.session
            if session is None or set(session.names) != set(spec):
                pipe.close()
                raise AccelerationInstallError(",".join(spec), "the denoiser has no install receipt for the "
                                               "requested accelerations; refusing to assemble the pipeline")
        return pipe

    # ------------------------------------------------------------------ generation
    def generate(self, request: DiffusionRequest) -> DiffusionResult:
        """Run one request. Returns latents, decoded frames (``np``/``mp4``), receipts and timings."""
        if self._closed:
            raise PipelineClosedError("this pipeline was closed; build a new one with from_pretrained")
        if not isinstance(request, DiffusionRequest):
            raise InvalidRequestError(f"generate() takes a DiffusionRequest, got {type(request).__name__}")
        recipe = self.components.recipe
        request = request.with_defaults(dict(recipe.defaults))
        if request.output_type != "latent" and self.components.codec is None:
            raise InvalidRequestError(
                f"output_type={request.output_type!r}: recipe {recipe.name!r} has no codec here; use 'latent'"
            )
        progress = request.progress if request.progress is not None else bool(self.policy.options.get("progress"))
        t0 = time.perf_counter()
        out = self._runner.run(request, progress=progress)
        timings = dict(out.timings)
        result = DiffusionResult(request_id=request.request_id or "", latents=out.latents, timings=timings)
        if hasattr(self._runner.driver, "split"):
            video, audio = self._runner.driver.split(out.prepared, out.latents)
            result.latents, result.audio_latents = video, audio
        if request.output_type != "latent":
            t_dec = time.perf_counter()
            video = self.components.codec.decode(result.latents)
            result.frames = video_to_uint8(video)
            if self.policy.device.type == "cuda":
                torch.cuda.synchronize(self.policy.device)
            timings["decode_s"] = time.perf_counter() - t_dec
            if request.output_type == "mp4":
                from worldfoundry.base_models.diffusion_model.video_io import write_mp4

                result.video_path = write_mp4(result.frames, request.output_path or "", fps=request.fps)
        timings["total_s"] = time.perf_counter() - t0
        result.receipts = self.request_receipts(result.request_id)
        result.provenance = {"recipe": recipe.name, "schedule": out.schedule, **self.components.weight_report()}
        return result

    def request_receipts(self, request_id: str) -> dict[str, Any]:
        """The install receipt and, per plugin and expert, the execution record of one request."""
        report = self.components.denoiser.runtime_optimization_report()
        plugins: dict[str, dict[str, Any]] = {}
        for name, per_expert in report.get("plugins", {}).items():
            for expert, rep in per_expert.items():
                requests = rep.get("requests", {}) if isinstance(rep, Mapping) else {}
                plugins.setdefault(name, {})[expert] = requests.get(request_id)
        codec = self.components.codec
        return {
            "installed": report.get("installed"),
            "execution_verified": False,
            "plugins": plugins,
            "codec": codec.execution_report() if codec is not None else None,
        }

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wait for the device, uninstall accelerations, drop every weight. Idempotent."""
        if self._closed:
            return
        if self.policy.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.policy.device)
        try:
            self.components.denoiser.uninstall()
        finally:
            self._closed = True
            self.components.denoiser.release()
            comp = self.components
            comp.text_encoder = comp.image_encoder = comp.codec = comp.tokenizer = comp.image_processor = None
            self._runner = None  # type: ignore[assignment]
            gc.collect()
            if self.policy.device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.empty_cache()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> NativeDiffusionPipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
