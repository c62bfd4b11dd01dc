"""One real block of a recipe's DiT and inputs shaped like a real request, for the residency estimator.

The full model is instantiated on the ``meta`` device (no memory), one block is materialised on the
target device with checkpoint weights (only that block's tensors are read from the safetensors files) or
seeded random weights, and cast with the loader's dtype policy (diffusers' fp32-kept modules stay fp32).

Inputs follow what the model's own forward hands its blocks:

* ``wan`` — ``hidden_states (1, tokens, dim)``, ``encoder_hidden_states (1, 512 [+257 image], dim)`` (512 or
  the recipe tokenizer's ``max_length``),
  ``temb (1, 6, dim)`` and ``rotary_emb`` from the model's own :class:`WanRotaryPosEmbed` for the latent
  grid (VAE ×4 in time, ×8 in space, then the patch size).
* ``minimax_h3`` — one packed sequence: ``hidden_states (1, rows, hidden)``, ``temb (2, time_embed_dim)``
  (fp32, two noise levels), ``adaln_indices`` (timestep × 3 + modality) and ``rotary_emb`` from the model's
  :class:`MiniMaxH3RotaryPosEmbed` over ``(t, h, w)`` positions; rows = text rows + video rows (VAE ×4 in
  time, ×16 in space, then the patch size) unless ``sequence_length`` is given.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import torch
import torch.nn as nn

from worldfoundry.core.model_loading.dtypes import apply_dtype_policy
from worldfoundry.core.model_loading.input_files import load_json_file
from worldfoundry.errors import CheckpointError, RecipeError

#: Families whose block inputs the estimator knows how to build.
ESTIMATOR_FAMILIES: Final = ("wan", "minimax_h3", "sana_video")
#: Text rows of a SANA-Video request when the recipe does not say (its tokenizer's max_length).
SANA_TEXT_TOKENS: Final = 300
WAN_TEXT_TOKENS: Final = 512
WAN_IMAGE_TOKENS: Final = 257
H3_TEXT_TOKENS: Final = 512
_SAFETENSORS_INDEX: Final = "diffusion_pytorch_model.safetensors.index.json"


class BlockFamily(Protocol):
    """What the probe needs to know of a model family: its name and its ``(path, block)`` list."""

    name: str

    def blocks(self, model: nn.Module) -> Sequence[tuple[str, nn.Module]]: ...


#: ``family_of(model) -> BlockFamily``; raises for an unsupported model (the model layer supplies it).
FamilyLookup = Callable[[nn.Module], BlockFamily]


@dataclass(frozen=True)
class DiTSource:
    """Where the DiT's architecture (and optionally weights) come from.

    Attributes:
        recipe: the recipe name or config path given.
        class_path: dotted diffusers class (``"diffusers.WanTransformer3DModel"``).
        config: the diffusers config.
        weights_dir: a diffusers-format directory holding the DiT's safetensors, or ``None``.
        origin: where the config was read (for the report).
        text_tokens: text sequence length of a request (the recipe tokenizer's ``max_length``), if known.
        spatial_stride / temporal_stride: the codec's compression (pixels per latent cell; frames per latent
            frame after the first), from the recipe's codec config (8 and 4 when not given).
        expand_timesteps: the denoiser gets one timestep per token (Wan2.2 TI2V), so blocks receive a
            per-token modulation.
    """

    recipe: str
    class_path: str
    config: Mapping[str, Any]
    weights_dir: Path | None = None
    origin: str = ""
    text_tokens: int | None = None
    spatial_stride: int = 8
    temporal_stride: int = 4
    expand_timesteps: bool = False


def _import(path: str) -> type:
    """The DiT class through the recipe class allowlist (a config file never imports arbitrary code)."""
    from worldfoundry.core.model_loading.class_allowlist import resolve_class

    return resolve_class(path, recipe="estimate-residency", component="denoiser")


def resolve_dit_source(recipe: str, checkpoint_dir: str | os.PathLike[str] | None = None) -> DiTSource:
    """Find the DiT class and config of ``recipe``.

    Args:
        recipe: a recipe name or YAML path (read with the project's recipe loader), or a diffusers
            ``config.json`` of the transformer.
        checkpoint_dir: a diffusers-format directory (the recipe's denoiser subfolder is used when present);
            its ``config.json`` wins over the recipe's config.

    Returns:
        The source.

    Raises:
        UnknownRecipeError / RecipeError: the recipe cannot be read.
    """
    path = Path(os.fspath(recipe))
    subfolder = "transformer"
    text_tokens = None
    strides: dict[str, Any] = {}
    if path.suffix == ".json" and path.is_file():
        config = load_json_file(path, what="transformer config")
        class_name = config.get("_class_name")
        if not class_name:
            raise RecipeError(f"{path}: a diffusers config needs a _class_name")
        class_path, origin = f"diffusers.{class_name}", str(path)
    else:
        from worldfoundry.core.model_loading.recipes import load_recipe

        loaded = load_recipe(recipe)
        spec = loaded.denoiser
        if not spec.class_path:
            raise RecipeError(f"recipe {loaded.name!r}: components.denoiser.class is missing")
        class_path, config, origin = spec.class_path, dict(spec.config), str(loaded.path or loaded.name)
        subfolder = loaded.expert_subfolders[0] if loaded.expert_subfolders else subfolder
        tokenizer = loaded.component("tokenizer")
        if tokenizer is not None and isinstance(tokenizer.get("max_length"), int):
            text_tokens = int(tokenizer.get("max_length"))
        codec = loaded.component("codec")
        codec_config = dict(codec.config) if codec is not None else {}
        for key, field_name in (("scale_factor_spatial", "spatial_stride"), ("scale_factor_temporal",
                                                                             "temporal_stride")):
            if isinstance(codec_config.get(key), int):
                strides[field_name] = int(codec_config[key])
        strides["expand_timesteps"] = bool(spec.get("expand_timesteps", False))
    weights_dir = None
    if checkpoint_dir is not None:
        root = Path(os.fspath(checkpoint_dir))
        weights_dir = root / subfolder if (root / subfolder).is_dir() else root
        if not weights_dir.is_dir():
            raise CheckpointError(f"checkpoint directory {weights_dir} does not exist")
        cfg_file = weights_dir / "config.json"
        if cfg_file.is_file():
            ckpt_config = load_json_file(cfg_file, what="transformer config")
            config = {k: v for k, v in ckpt_config.items() if not k.startswith("_")}
            origin = str(cfg_file)
    return DiTSource(str(recipe), class_path, {k: v for k, v in config.items() if not k.startswith("_")},
                     weights_dir, origin, text_tokens, **strides)


@dataclass
class ProbeBlock:
    """One materialised block and the facts about the model it came from."""

    block: nn.Module
    family: str
    path: str
    num_blocks: int
    model_class: type
    config: Mapping[str, Any]
    keep_fp32: tuple[str, ...]
    weights: str
    text_tokens: int | None = None
    spatial_stride: int = 8
    temporal_stride: int = 4
    expand_timesteps: bool = False

    def latent_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Latent frames × height × width of a request of ``frames`` × ``height`` × ``width`` pixels."""
        return ((frames - 1) // self.temporal_stride + 1, height // self.spatial_stride, width // self.spatial_stride)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.block.parameters())


def _read_block_tensors(weights_dir: Path, prefix: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = weights_dir / _SAFETENSORS_INDEX
    if index.is_file():
        weight_map = load_json_file(index, what="safetensors index").get("weight_map", {})
        files = sorted({weights_dir / f for k, f in weight_map.items() if k.startswith(prefix)})
    else:
        files = sorted(weights_dir.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                if key.startswith(prefix):
                    tensors[key[len(prefix):]] = handle.get_tensor(key)
    if not tensors:
        raise CheckpointError(f"no tensors with prefix {prefix!r} in {weights_dir}")
    return tensors


def _random_init(block: nn.Module, seed: int, device: torch.device) -> None:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        covered: set[int] = set()
        for module in block.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
                covered.update(id(p) for p in module._parameters.values() if p is not None)
        for p in block.parameters():
            if id(p) not in covered:
                p.normal_(0.0, 0.02)


def build_probe_block(source: DiTSource, *, family_of: FamilyLookup, device: torch.device, dtype: torch.dtype,
                      random_weights: bool, index: int = 0, seed: int = 0) -> ProbeBlock:
    """Materialise block ``index`` of the DiT on ``device``.

    Args:
        source: from :func:`resolve_dit_source`.
        family_of: the model layer's family lookup (which modules are the blocks); handed down, so this
            module does not depend on the model layer.
        device / dtype: where and in which compute dtype (fp32-kept modules stay fp32).
        random_weights: seeded random weights instead of the checkpoint's.
        index: which block (all blocks of the supported families have the same shape).
        seed: random seed for random weights.

    Raises:
        CheckpointError: weights requested but not found.
        RecipeError: the class cannot be built or the family is not supported by the estimator.
    """
    cls = _import(source.class_path)
    with torch.device("meta"):
        model = cls.from_config(dict(source.config))
    family = family_of(model)
    if family.name not in ESTIMATOR_FAMILIES:
        raise RecipeError(f"estimate-residency builds block inputs for {ESTIMATOR_FAMILIES}, not {family.name!r}")
    blocks = family.blocks(model)
    if not 0 <= index < len(blocks):
        raise RecipeError(f"block index {index} outside 0..{len(blocks) - 1}")
    path, block = blocks[index]
    keep = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
    block = block.to_empty(device=device)
    if random_weights or source.weights_dir is None:
        if not random_weights:
            raise CheckpointError("no checkpoint directory given; pass --checkpoint-dir D or --random-weights")
        _random_init(block, seed, device)
        weights = f"random (seed {seed})"
    else:
        tensors = _read_block_tensors(source.weights_dir, f"{path}.")
        try:
            block.load_state_dict(tensors, strict=True)
        except RuntimeError as exc:
            raise CheckpointError(f"{source.weights_dir}: block {path} does not match the config: {exc}") from exc
        weights = str(source.weights_dir)
    apply_dtype_policy(block, dtype, keep)  # names relative to the block match the fp32-kept module names
    del model
    return ProbeBlock(block.eval().requires_grad_(False), family.name, path, len(blocks), cls,
                      dict(source.config), keep, weights, source.text_tokens, source.spatial_stride,
                      source.temporal_stride, source.expand_timesteps)


@dataclass(frozen=True)
class ProbeInputs:
    """Fresh block inputs per call of :attr:`make` (the hidden states are cloned; nothing else changes)."""

    make: Callable[[], dict[str, Any]]
    tokens: int
    shapes: Mapping[str, Any] = field(default_factory=dict)


def _policy_module(module: nn.Module, name: str, dtype: torch.dtype, keep: tuple[str, ...]) -> nn.Module:
    holder = nn.Module()
    holder.add_module(name, module)
    apply_dtype_policy(holder, dtype, keep)
    return getattr(holder, name)


def _describe(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            out[key] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        elif isinstance(value, tuple | list):
            out[key] = [_describe({"t": v})["t"] for v in value]
    return out


def _wan_inputs(probe: ProbeBlock, frames: int, height: int, width: int, device: torch.device,
                dtype: torch.dtype, gen: torch.Generator, sequence_length: int | None) -> tuple[dict[str, Any], int]:
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    cfg = probe.config
    heads, head_dim = int(cfg.get("num_attention_heads", 40)), int(cfg.get("attention_head_dim", 128))
    dim = heads * head_dim
    patch = tuple(cfg.get("patch_size", (1, 2, 2)))
    lat = probe.latent_grid(frames, height, width)
    grid = (lat[0] // patch[0], lat[1] // patch[1], lat[2] // patch[2])
    if sequence_length is not None:
        raise RecipeError("sequence_length applies to minimax_h3 packed sequences; Wan tokens come from the frames "
                          "and the size")
    tokens = math.prod(grid)
    if tokens < 1:
        raise RecipeError(f"frames={frames} height={height} width={width} give no latent tokens")
    rope = WanRotaryPosEmbed(head_dim, patch, int(cfg.get("rope_max_seq_len", 1024)))
    rope = _policy_module(rope, "rope", dtype, probe.keep_fp32).to(device)
    rotary = rope(torch.empty((1, 1, *lat), device="meta"))
    image = WAN_IMAGE_TOKENS if cfg.get("image_dim") or cfg.get("added_kv_proj_dim") else 0
    text = (probe.text_tokens or WAN_TEXT_TOKENS) + image
    kwargs = {
        "hidden_states": torch.randn(1, tokens, dim, generator=gen).to(device, dtype),
        "encoder_hidden_states": torch.randn(1, text, dim, generator=gen).to(device, dtype),
        # one modulation per token when the denoiser gets per-token timesteps (Wan2.2 TI2V), else per sample
        "temb": (torch.randn(1, *((tokens,) if probe.expand_timesteps else ()), 6, dim, generator=gen) * 0.1
                 ).to(device, dtype),
        "rotary_emb": tuple(r.to(device) for r in rotary),
    }
    return kwargs, tokens


def _h3_inputs(probe: ProbeBlock, frames: int, height: int, width: int, device: torch.device,
               dtype: torch.dtype, gen: torch.Generator, sequence_length: int | None) -> tuple[dict[str, Any], int]:
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MINIMAX_H3_MODALITY_NUM,
        MiniMaxH3RotaryPosEmbed,
    )

    cfg = probe.config
    hidden = int(cfg.get("hidden_size", 5376))
    patch = tuple(cfg.get("patch_size", (1, 2, 2)))
    lat = ((frames - 1) // 4 + 1, height // 16 // patch[1], width // 16 // patch[2])
    video_rows = math.prod(lat)
    rows = int(sequence_length) if sequence_length is not None else video_rows + H3_TEXT_TOKENS
    text_rows = max(0, rows - video_rows) if sequence_length is None else min(H3_TEXT_TOKENS, rows // 8)
    video_rows = rows - text_rows
    t = torch.arange(video_rows) // max(1, lat[1] * lat[2])
    hw = torch.arange(video_rows) % max(1, lat[1] * lat[2])
    video_pos = torch.stack([t, hw // max(1, lat[2]), hw % max(1, lat[2])], dim=1)
    text_pos = torch.zeros(text_rows, 3, dtype=torch.long)
    position_ids = torch.cat([text_pos, video_pos]).to(device)
    token_tags = torch.cat([torch.ones(text_rows, dtype=torch.long), torch.zeros(video_rows, dtype=torch.long)])
    timestep_indices = torch.cat([torch.zeros(text_rows, dtype=torch.long), torch.ones(video_rows, dtype=torch.long)])
    rope = MiniMaxH3RotaryPosEmbed(int(cfg.get("rope_freq_dim", 16)), float(cfg.get("rope_theta", 10000.0)))
    rope = _policy_module(rope, "rope", dtype, probe.keep_fp32).to(device)
    kwargs = {
        "hidden_states": torch.randn(1, rows, hidden, generator=gen).to(device, dtype),
        "temb": torch.randn(2, int(cfg.get("time_embed_dim", 2688)), generator=gen).to(device, torch.float32),
        "adaln_indices": (timestep_indices * MINIMAX_H3_MODALITY_NUM + token_tags).to(device),
        "rotary_emb": rope(position_ids),
    }
    return kwargs, rows


def _sana_video_inputs(probe: ProbeBlock, frames: int, height: int, width: int, device: torch.device,
                       dtype: torch.dtype, gen: torch.Generator,
                       sequence_length: int | None) -> tuple[dict[str, Any], int]:
    """The arguments SANA-Video passes its blocks, captured from the model itself: a copy of the model with one
    block (same config otherwise, random weights) runs once on a request-shaped latent, and a pre-hook on that
    block records what it receives (modulation, rotary embedding, caption states, frame/height/width)."""
    import inspect

    if sequence_length is not None:
        raise RecipeError("sequence_length applies to minimax_h3 packed sequences; SANA-Video tokens come from the "
                          "frames and the size")
    cfg = dict(probe.config)
    cfg["num_layers"] = 1
    with torch.device("meta"):
        model = probe.model_class.from_config(cfg)
    apply_dtype_policy(model, dtype, probe.keep_fp32)
    model.to_empty(device=device)
    _random_init(model, 0, device)
    rope = getattr(model, "rope", None)
    if rope is not None:  # rotary tables are buffers computed at construction: rebuild them for real values
        fresh = type(rope)(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
        model.rope = _policy_module(fresh, "rope", dtype, probe.keep_fp32).to(device)
    lat = probe.latent_grid(frames, height, width)
    patch = tuple(cfg.get("patch_size", (1, 2, 2)))
    tokens = math.prod(n // p for n, p in zip(lat, patch, strict=True))
    if tokens < 1:
        raise RecipeError(f"frames={frames} height={height} width={width} give no latent tokens")
    text = probe.text_tokens or SANA_TEXT_TOKENS
    latent = torch.randn(1, int(cfg.get("in_channels", 16)), *lat, generator=gen).to(device, dtype)
    caption = torch.randn(1, text, int(cfg.get("caption_channels", 2304)), generator=gen).to(device, dtype)
    block = model.transformer_blocks[0]
    names = list(inspect.signature(block.forward).parameters)
    captured: dict[str, Any] = {}

    def grab(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.update(zip(names, args))
        captured.update(kwargs)
        raise _Captured

    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(hidden_states=latent, encoder_hidden_states=caption, timestep=torch.tensor([500], device=device))
    except _Captured:
        pass
    finally:
        handle.remove()
    if "hidden_states" not in captured:
        raise RecipeError(f"{probe.model_class.__name__} did not call its first block")
    kwargs = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in captured.items()}
    del model
    return kwargs, tokens


class _Captured(Exception):
    """Stops the one-block model once its block's inputs are recorded."""


def build_probe_inputs(probe: ProbeBlock, *, frames: int, height: int, width: int, device: torch.device,
                       dtype: torch.dtype, sequence_length: int | None = None, seed: int = 0) -> ProbeInputs:
    """Inputs for ``probe.block`` matching a request of ``frames`` × ``height`` × ``width``.

    Args:
        probe: from :func:`build_probe_block`.
        frames / height / width: the request's video size (pixels).
        device / dtype: where the block runs and its compute dtype.
        sequence_length: the packed row count (minimax_h3 only; Wan derives tokens from the size).
        seed: seed of the random activations.

    Returns:
        :class:`ProbeInputs`; ``make()`` returns keyword arguments for ``probe.block``.
    """
    gen = torch.Generator().manual_seed(seed)
    builder = {"wan": _wan_inputs, "minimax_h3": _h3_inputs, "sana_video": _sana_video_inputs}[probe.family]
    base, tokens = builder(probe, frames, height, width, device, dtype, gen, sequence_length)
    hidden = base["hidden_states"]

    def make() -> dict[str, Any]:
        fresh = dict(base)
        fresh["hidden_states"] = hidden.clone()
        return fresh

    return ProbeInputs(make, tokens, _describe(base))
