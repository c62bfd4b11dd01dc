"""Assemble a recipe's components: tokenizer, text/image encoders, denoiser experts, scheduler, codec.

Weight sources, in order: ``checkpoint_overrides`` (single files) > ``checkpoint_dir`` (diffusers layout) >
local Hugging Face cache (``local_files_only=True``). Offline recipes and ``random_weights=True`` build every
component from the recipe config with seeded random weights. A failure releases everything loaded so far.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from worldfoundry.core.model_loading.local_tokenizer import build_local_tokenizer
from worldfoundry.core.model_loading.policy import RuntimePolicy, parse_dtype
from worldfoundry.core.model_loading.recipes import ComponentSpec, Recipe
from worldfoundry.core.model_loading.weights import (
    WeightSource,
    build_random,
    check_config_matches,
    import_class,
    load_pretrained,
    load_single_file,
)
from worldfoundry.errors import MissingWeightsError, RecipeError

logger = logging.getLogger(__name__)

#: checkpoint_overrides keys accepted per component (aliases used by recipes and users).
OVERRIDE_ALIASES: dict[str, tuple[str, ...]] = {
    "codec": ("codec", "vae"),
    "text_encoder": ("text_encoder",),
    "image_encoder": ("image_encoder",),
}
_SEED_OFFSETS = {"text_encoder": 1, "image_encoder": 2, "codec": 3, "denoiser": 10}


@dataclass
class LoadedComponents:
    """Everything a pipeline needs, plus where each weight came from."""

    recipe: Recipe
    policy: RuntimePolicy
    tokenizer: Any = None
    text_encoder: nn.Module | None = None
    image_encoder: nn.Module | None = None
    image_processor: Any = None
    experts: dict[str, nn.Module] = field(default_factory=dict)
    scheduler: Any = None
    codec_module: nn.Module | None = None
    codec_options: dict[str, Any] = field(default_factory=dict)
    sources: list[WeightSource] = field(default_factory=list)
    random_weights: bool = False

    def release(self) -> None:
        self.text_encoder = self.image_encoder = self.codec_module = None
        self.experts.clear()
        self.tokenizer = self.image_processor = self.scheduler = None


def split_component_options(component_options: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """``{"latent_encoder:codec": {...}}`` -> ``{"codec": {...}}`` (the part after the colon names the component)."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in (component_options or {}).items():
        if not isinstance(value, Mapping):
            raise RecipeError(f"component_options[{key!r}] must be a mapping of options")
        component = str(key).split(":")[-1]
        out.setdefault(component, {}).update(value)
    return out


def _dtype_for(component: str, policy: RuntimePolicy, options: Mapping[str, Any]) -> torch.dtype:
    """Component options override runtime options of the same name."""
    runtime_key = {"denoiser": "dit_weight_dtype", "text_encoder": "text_encoder_dtype", "codec": "vae_dtype"}.get(
        component
    )
    if "dtype" in options:
        return parse_dtype(options["dtype"], field_name=f"component_options.{component}.dtype")
    if runtime_key and runtime_key in options:
        return parse_dtype(options[runtime_key], field_name=f"component_options.{component}.{runtime_key}")
    value = policy.options.get(runtime_key) if runtime_key else None
    if value is not None:
        return value
    if component == "codec":
        return torch.float32  # the Wan VAE runs in fp32 unless asked otherwise
    return policy.dtype


def _override_for(component: str, overrides: Mapping[str, Any]) -> Any:
    for alias in OVERRIDE_ALIASES.get(component, (component,)):
        if alias in overrides:
            return overrides[alias]
    return None


def _load_module(spec: ComponentSpec, recipe: Recipe, *, subfolder: str | None, override: Any, random: bool,
                 seed: int, checkpoint_dir: str | None, device: torch.device,
                 dtype: torch.dtype) -> tuple[nn.Module, WeightSource]:
    if spec.get("weights") == "none":  # a fixed transform without weights (e.g. the pixel-patch codec)
        module = build_random(spec, recipe, seed=seed, device=device, dtype=None)
        return module, WeightSource(spec.name, "config")
    if override is not None:
        module, source = load_single_file(spec, recipe, override, device=device, dtype=dtype)
    elif random:
        module, source = build_random(spec, recipe, seed=seed, device=device, dtype=dtype), WeightSource(
            spec.name, "random", None, seed
        )
    else:
        module, source = load_pretrained(spec, recipe, subfolder=subfolder, checkpoint_dir=checkpoint_dir,
                                         device=device, dtype=dtype)
    if not source.random:
        check_config_matches(module, spec, recipe)
    return module, source


def load_components(
    recipe: Recipe,
    policy: RuntimePolicy,
    *,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_overrides: Mapping[str, Any] | None = None,
    component_options: Mapping[str, Any] | None = None,
    random_weights: bool = False,
) -> LoadedComponents:
    """Load every component of ``recipe`` on ``policy.device``.

    Raises:
        MissingWeightsError / CheckpointError / RecipeError: nothing stays loaded after a failure.
    """
    overrides = dict(checkpoint_overrides or {})
    comp_opts = split_component_options(component_options)
    known_override_keys = {"denoiser", "transformer", "transformer_2", *recipe.experts,
                           *(a for v in OVERRIDE_ALIASES.values() for a in v)}
    unknown = sorted(set(overrides) - known_override_keys)
    if unknown:
        raise RecipeError(f"checkpoint_overrides: unknown component(s) {unknown}; known: {sorted(known_override_keys)}")
    for key, value in overrides.items():  # fail before loading anything
        if not os.path.isfile(os.fspath(value)):
            raise MissingWeightsError(recipe.name, key, [os.fspath(value)], "Check the checkpoint_overrides path.")
    random = recipe.offline or random_weights
    if checkpoint_dir is None and recipe.assets_dir is not None:
        checkpoint_dir = recipe.assets_dir  # weights shipped with the recipe
    ckpt = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
    device = policy.device
    loaded = LoadedComponents(recipe=recipe, policy=policy, random_weights=random)
    try:
        _load_text_side(loaded, recipe, policy, comp_opts, overrides, random, ckpt)
        _load_denoiser(loaded, recipe, policy, comp_opts, overrides, random, ckpt)
        sched = recipe.component("scheduler")
        if sched is None:
            raise RecipeError(f"recipe {recipe.name!r}: no scheduler component")
        loaded.scheduler = import_class(sched.class_path, recipe=recipe.name, component="scheduler").from_config(
            dict(sched.config)
        )
        _load_codec(loaded, recipe, policy, comp_opts, overrides, random, ckpt)
    except BaseException:
        loaded.release()
        del loaded
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise
    return loaded


def _load_codec(loaded: LoadedComponents, recipe: Recipe, policy: RuntimePolicy,
                comp_opts: Mapping[str, Mapping[str, Any]], overrides: Mapping[str, Any], random: bool,
                ckpt: str | None) -> None:
    """Load the recipe's own codec, or keep the options of another codec variant for the pipeline to build.

    Raises:
        UnsupportedCodecOptionError: an option the recipe's own codec does not take.
    """
    codec_spec = recipe.component("codec")
    codec_variant = comp_opts.get("codec", {}).get("variant", "wan2.1")
    if codec_spec is not None and codec_variant != "wan2.1":
        # another codec variant (a student codec): built by the pipeline from these options
        loaded.codec_options = {"recipe_default_tiled": bool(codec_spec.get("tiled", False)),
                                "path": _override_for("codec", overrides), **comp_opts["codec"]}
    elif codec_spec is not None:
        options = {"tiled": bool(codec_spec.get("tiled", False)), **comp_opts.get("codec", {})}
        unknown = sorted(set(options) - {"tiled", "dtype", "vae_dtype", "variant"})
        if unknown:
            from worldfoundry.errors import UnsupportedCodecOptionError

            raise UnsupportedCodecOptionError(
                unknown[0], "not available for the recipe's own codec (options: tiled, dtype, variant); FP8 encoder "
                "calibration needs the student codec's variant in component_options['latent_encoder:codec']")
        dtype = _dtype_for("codec", policy, options)
        module, source = _load_module(
            codec_spec, recipe, subfolder=codec_spec.subfolder, override=_override_for("codec", overrides),
            random=random, seed=recipe.seed + _SEED_OFFSETS["codec"], checkpoint_dir=ckpt, device=policy.device,
            dtype=dtype,
        )
        loaded.codec_module, loaded.codec_options = module, {**options, "dtype": dtype}
        loaded.sources.append(source)


def _load_text_side(loaded: LoadedComponents, recipe: Recipe, policy: RuntimePolicy,
                    comp_opts: Mapping[str, Mapping[str, Any]], overrides: Mapping[str, Any], random: bool,
                    ckpt: str | None) -> None:
    tok = recipe.component("tokenizer")
    if tok is not None:
        max_length = int(tok.get("max_length", 64))
        if random or tok.get("kind") == "local_word":
            loaded.tokenizer = build_local_tokenizer(max_length)
            loaded.sources.append(WeightSource("tokenizer", "local_tokenizer"))
        else:
            loaded.tokenizer = _load_pretrained_tokenizer(recipe, tok, ckpt)
    for name in ("text_encoder", "image_encoder"):
        spec = recipe.component(name)
        if spec is None:
            continue
        dtype = _dtype_for(name, policy, comp_opts.get(name, {}))
        module, source = _load_module(
            spec, recipe, subfolder=spec.subfolder, override=_override_for(name, overrides), random=random,
            seed=recipe.seed + _SEED_OFFSETS[name], checkpoint_dir=ckpt, device=policy.device, dtype=dtype,
        )
        setattr(loaded, name, module)
        loaded.sources.append(source)
    proc = recipe.component("image_processor")
    if proc is not None:
        cls = import_class(proc.class_path, recipe=recipe.name, component="image_processor")
        loaded.image_processor = cls(**dict(proc.config))


def _load_pretrained_tokenizer(recipe: Recipe, spec: ComponentSpec, ckpt: str | None) -> Any:
    from transformers import AutoTokenizer

    from pathlib import Path

    from worldfoundry.core.model_loading.weights import check_component_dir

    looked_at = []
    for location in ([ckpt] if ckpt else []) + ([recipe.hf_repo] if recipe.hf_repo else []):
        looked_at.append(f"{location}/{spec.subfolder or 'tokenizer'}")
        if location == ckpt and (Path(ckpt) / (spec.subfolder or "tokenizer")).is_dir():
            check_component_dir(Path(ckpt) / (spec.subfolder or "tokenizer"))  # stat every file before reading
        try:
            return AutoTokenizer.from_pretrained(location, subfolder=spec.subfolder or "tokenizer",
                                                 local_files_only=True)
        except (OSError, ValueError):
            continue
    raise MissingWeightsError(recipe.name, "tokenizer", looked_at)


def _load_denoiser(loaded: LoadedComponents, recipe: Recipe, policy: RuntimePolicy,
                   comp_opts: Mapping[str, Mapping[str, Any]], overrides: Mapping[str, Any], random: bool,
                   ckpt: str | None) -> None:
    spec = recipe.denoiser
    dtype = _dtype_for("denoiser", policy, comp_opts.get("denoiser", {}))
    for index, (expert, subfolder) in enumerate(zip(recipe.experts, recipe.expert_subfolders)):
        override = overrides.get(expert) or overrides.get(subfolder)
        if override is None and index == 0:
            override = overrides.get("denoiser")
        module, source = _load_module(
            ComponentSpec(f"denoiser:{expert}", spec.class_path, spec.config_class, spec.config, subfolder),
            recipe, subfolder=subfolder, override=override, random=random,
            seed=recipe.seed + _SEED_OFFSETS["denoiser"] + index, checkpoint_dir=ckpt, device=policy.device,
            dtype=dtype,
        )
        loaded.experts[expert] = module
        loaded.sources.append(source)
