"""``apply_dit_attention_lora``: the adapter for the duration of a ``with`` block, built on the same plugin."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch.nn as nn

from worldfoundry.base_models.diffusion_model.optimizations.attention_lora_format import (
    QKV_PER_HEAD_INTERLEAVED,
)
from worldfoundry.plugin import (
    AccelerationRefusedError,
    AccelerationRegistry,
    AccelerationSession,
    RuntimePolicy,
    SessionAlreadyInstalledError,
    get_session,
    install_diffusion_accelerations,
)
from worldfoundry_attention_lora.options import NAME

DISTRIBUTION = "worldfoundry-attention-lora"


def _distribution_version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
from worldfoundry_attention_lora.plugin import make_prepare
from worldfoundry_attention_lora.source import (
    AdapterSource,
    load_adapter_file,
    state_dict_source,
)


def resolve_transformers(model_or_pipeline: Any) -> nn.Module | dict[str, nn.Module]:
    """The transformer(s) of a model or pipeline.

    Accepts an ``nn.Module``, a :class:`NativeDiffusionPipeline` (its denoiser's experts) or a diffusers pipeline
    (its ``transformer``).

    Raises:
        TypeError: nothing adaptable was found.
    """
    if isinstance(model_or_pipeline, nn.Module):
        return model_or_pipeline
    denoiser = getattr(getattr(model_or_pipeline, "components", None), "denoiser", None)
    experts = getattr(denoiser, "experts", None)
    if isinstance(experts, Mapping) and experts:
        return next(iter(experts.values())) if len(experts) == 1 else dict(experts)
    model = getattr(denoiser, "model", None)
    if isinstance(model, nn.Module):
        return model
    transformer = getattr(model_or_pipeline, "transformer", None)
    if isinstance(transformer, nn.Module):
        return transformer
    raise TypeError(
        f"cannot find a transformer in {type(model_or_pipeline).__name__}; pass the diffusers transformer module, "
        "a NativeDiffusionPipeline or a diffusers pipeline"
    )


@contextlib.contextmanager
def apply_dit_attention_lora(model_or_pipeline: Any, state_dict: Mapping[str, Any] | str | os.PathLike[str],
                             rank: int = 8, scale: float = -1.0, *, qkv_layout: str = QKV_PER_HEAD_INTERLEAVED,
                             policy: RuntimePolicy | None = None) -> Iterator[AccelerationSession]:
    """Apply a DiT attention adapter inside the ``with`` block; leaving it (also by an exception) restores the model.

    The adapter is installed through the ``attention_lora`` plugin's own prepare/activate path, so every check,
    claim, refusal and receipt is the same as for the spec ``{"attention_lora": {...}}``.

    Args:
        model_or_pipeline: the transformer module, a ``NativeDiffusionPipeline`` or a diffusers pipeline.
        state_dict: the complete adapter state (CPU FP32 tensors) or the path of a ``.safetensors`` file.
        rank: the adapter rank (every tensor must have it).
        scale: effective scale in ``[-1, 1]``, alpha/rank folded in.
        qkv_layout: row order of the MiniMax-H3 fused ``qkv_proj.lora_B``.
        policy: runtime policy (defaults to the model's device and dtype).

    Yields:
        The :class:`AccelerationSession`; its ``execution_report()`` stays readable after the block.

    Raises:
        AccelerationRefusedError: an attention adapter is already applied (nested use) or the model refuses.
        SessionAlreadyInstalledError: the model carries another acceleration session; uninstall it first.
        ModelBusyError: a request is running on the model.
        ArtifactMismatchError / AccelerationOptionsError: the adapter or the options are invalid; nothing is attached.

    Example:
        >>> from safetensors.torch import load_file                       # doctest: +SKIP
        >>> state = load_file("attention-adapter.safetensors", device="cpu")  # doctest: +SKIP
        >>> with apply_dit_attention_lora(transformer, state, rank=8, scale=-1.0) as session:  # doctest: +SKIP
        ...     out = transformer(**inputs)
        >>> session.execution_report()["installed"]                       # doctest: +SKIP
        False
    """
    targets = resolve_transformers(model_or_pipeline)
    modules = targets.values() if isinstance(targets, dict) else (targets,)
    for module in modules:
        session = get_session(module)
        if session is not None:
            if NAME in session.names:
                raise AccelerationRefusedError(
                    NAME, "an attention adapter is already applied to this model (nested apply_dit_attention_lora or "
                          "an installed attention_lora); leave the outer one first"
                )
            raise SessionAlreadyInstalledError(session.names)
    source: AdapterSource
    if isinstance(state_dict, str | os.PathLike):
        source = load_adapter_file(state_dict)
    else:
        source = state_dict_source(state_dict)
    registry = AccelerationRegistry(discover=False)
    registry.register(NAME, make_prepare(source), distribution=DISTRIBUTION, version=_distribution_version())
    options = {"rank": rank, "scale": scale, "qkv_layout": qkv_layout}
    session = install_diffusion_accelerations(targets, {NAME: options}, policy, registry=registry)
    try:
        yield session
    finally:
        session.uninstall()
