"""Prepare-time refusals specific to EasyCache. Each check only reads the model and names what it found."""

from __future__ import annotations

import inspect
import re
from typing import Final

import torch.nn as nn

from worldfoundry.plugin import AccelerationRefusedError, family_of, refuse_common
from worldfoundry_easycache.options import PLUGIN_NAME

#: Forward arguments of streaming / causal models (rolling KV caches, chunked generation).
STREAMING_ARGUMENTS: Final = frozenset(
    {"kv_cache", "crossattn_cache", "current_start", "cache_start", "frame_seq_length", "kv_cache_start"}
)
#: Forward arguments that feed a camera/control sub-graph (VACE, Wan-Animate, ControlNet-style inputs).
CONTROL_ARGUMENTS: Final = frozenset(
    {
        "control_hidden_states",
        "control_hidden_states_scale",
        "controlnet_states",
        "pose_hidden_states",
        "face_pixel_values",
        "camera_embeds",
        "camera_conditions",
        "plucker_embeddings",
    }
)
_CONTROL_NAME: Final = re.compile(r"vace|control|camera|plucker|pose_|face_adapter|face_encoder|motion_encoder", re.I)
_APPROXIMATE_PROCESSOR: Final = re.compile(r"sage|sparse|radial|sliding|svg|approx|int8|fp8|quant", re.I)
#: Marker attributes a caller (or another plugin) sets on a model or module.
STREAMING_MARKER: Final = "_worldfoundry_streaming"
INPLACE_RESIDUAL_MARKERS: Final = ("_worldfoundry_inplace_residual", "inplace_residual")


def _forward_parameters(model: nn.Module) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def refuse_feature_caches(model: nn.Module) -> None:
    """Another feature cache is active (diffusers ``enable_cache``, cache-dit); other diffusers hooks are caught by
    the shared refusals."""
    if getattr(model, "_cache_config", None) is not None:
        raise AccelerationRefusedError(
            PLUGIN_NAME,
            f"another feature cache is enabled on the model ({type(model._cache_config).__name__} via diffusers "
            "enable_cache); call model.disable_cache() first",
        )
    for name, module in model.named_modules():
        if module.__dict__.get("_is_cached") or module.__dict__.get("_context_manager") is not None:
            raise AccelerationRefusedError(
                PLUGIN_NAME, f"another feature cache (cache-dit) is attached to {name or '<root>'}; disable it first"
            )


def refuse_streaming(model: nn.Module, params: frozenset[str]) -> None:
    if getattr(model, STREAMING_MARKER, False):
        raise AccelerationRefusedError(PLUGIN_NAME, "the model is set up for streaming inputs (rolling generation)")
    found = sorted(params & STREAMING_ARGUMENTS)
    if found:
        raise AccelerationRefusedError(
            PLUGIN_NAME,
            f"streaming inputs: the model's forward takes {found}; a cached step cannot follow a rolling cache",
        )


def refuse_control_subgraphs(model: nn.Module, params: frozenset[str]) -> None:
    found = sorted(params & CONTROL_ARGUMENTS)
    if found:
        raise AccelerationRefusedError(
            PLUGIN_NAME,
            f"camera/control sub-graph: {type(model).__name__}.forward takes {found}; the cached transformation "
            "would ignore the control inputs",
        )
    if _CONTROL_NAME.search(type(model).__name__):
        raise AccelerationRefusedError(PLUGIN_NAME, f"camera/control sub-graph: model class {type(model).__name__}")
    for name, module in model.named_modules():
        if name and (_CONTROL_NAME.search(name.rsplit(".", 1)[-1]) or _CONTROL_NAME.search(type(module).__name__)):
            raise AccelerationRefusedError(
                PLUGIN_NAME, f"camera/control sub-graph: module {name} ({type(module).__name__})"
            )


def refuse_offload(model: nn.Module) -> None:
    devices = set()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.device.type == "meta":
            raise AccelerationRefusedError(PLUGIN_NAME, f"offload: {name} is on the meta device")
        devices.add(str(tensor.device))
    if len(devices) > 1:
        raise AccelerationRefusedError(
            PLUGIN_NAME,
            f"offload: parameters span several devices ({', '.join(sorted(devices))}); keep the model resident",
        )
    for name, module in model.named_modules():
        if getattr(module, "_hf_hook", None) is not None:
            raise AccelerationRefusedError(
                PLUGIN_NAME, f"offload: accelerate hook on {name or '<root>'} ({type(module._hf_hook).__name__})"
            )


def refuse_approximate_attention(model: nn.Module) -> None:
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None:
            continue
        cls = type(processor).__name__
        if _APPROXIMATE_PROCESSOR.search(cls):
            raise AccelerationRefusedError(PLUGIN_NAME, f"approximate attention processor {cls} on {name}")
        backend = getattr(processor, "_attention_backend", None)
        backend_name = str(getattr(backend, "value", backend) or "")
        if "sage" in backend_name.lower():
            raise AccelerationRefusedError(
                PLUGIN_NAME, f"approximate attention backend {backend_name!r} on {name} ({cls})"
            )


def refuse_inplace_residual(model: nn.Module) -> None:
    for name, module in model.named_modules():
        for marker in INPLACE_RESIDUAL_MARKERS:
            if getattr(module, marker, False) is True:
                raise AccelerationRefusedError(
                    PLUGIN_NAME,
                    f"in-place residual updates on {name or '<root>'} ({marker}); the cache needs the raw input",
                )


def refuse_shapes(model: nn.Module, params: frozenset[str]) -> None:
    if "hidden_states" not in params:
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"{type(model).__name__}.forward has no hidden_states argument (a latent-in, latent-out DiT)"
        )
    if "timestep" not in params:
        raise AccelerationRefusedError(PLUGIN_NAME, f"{type(model).__name__}.forward has no timestep argument")
    config = getattr(model, "config", None)
    in_channels = getattr(config, "in_channels", None)
    out_channels = getattr(config, "out_channels", None) or in_channels
    if isinstance(in_channels, int) and isinstance(out_channels, int) and out_channels > in_channels:
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"out_channels {out_channels} > in_channels {in_channels}: output and input latents differ"
        )


#: Model families EasyCache supports (a latent-in, latent-out DiT with one output).
SUPPORTED_FAMILIES: Final = ("wan", "sana_video")
#: Optional forward inputs from an external control network; calls that pass them are refused.
RUNTIME_CONTROL_ARGUMENTS: Final = ("controlnet_block_samples",)


def check_model(model: nn.Module) -> None:
    """Every EasyCache prepare-time refusal, most specific first.

    Raises:
        AccelerationRefusedError: naming the unsupported model, module, processor or state.
    """
    params = _forward_parameters(model)
    refuse_streaming(model, params)
    refuse_control_subgraphs(model, params)
    family = family_of(model, plugin=PLUGIN_NAME)
    if family.name not in SUPPORTED_FAMILIES:
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"{type(model).__name__} ({family.name}) has no single latent output to cache; "
            f"supported families: {list(SUPPORTED_FAMILIES)}"
        )
    refuse_feature_caches(model)
    refuse_offload(model)
    refuse_common(model, PLUGIN_NAME)
    refuse_approximate_attention(model)
    refuse_inplace_residual(model)
    refuse_shapes(model, params)


def latent_channels(model: nn.Module) -> int | None:
    """Channels of the noisy latent inside ``hidden_states`` (fewer than the input for image-to-video models,
    whose condition channels follow the latent in diffusers' concatenation order)."""
    config = getattr(model, "config", None)
    out_channels = getattr(config, "out_channels", None) or getattr(config, "in_channels", None)
    return int(out_channels) if isinstance(out_channels, int) else None
