"""Entry point of the ``easycache`` acceleration: option parsing, prepare-time refusals and activation."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.nn as nn

import worldfoundry
from worldfoundry.plugin import (
    ROLE_APPROXIMATE_ATTENTION,
    ROLE_FEATURE_CACHE,
    ROLE_OFFLOAD,
    ROOT_MODULE,
    PreparedAcceleration,
    RuntimePolicy,
    role,
)
from worldfoundry_easycache.handle import EasyCacheHandle
from worldfoundry_easycache.options import PLUGIN_NAME, Options
from worldfoundry_easycache.refusals import check_model, latent_channels

#: Role of plugins that update residual streams in place (EasyCache needs the raw model input intact).
ROLE_INPLACE_RESIDUAL = role("inplace_residual")


def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
    """Validate options and model; return the plan (the model is not changed).

    Args:
        model: a diffusers Wan or SANA-Video transformer (one expert of a routed denoiser is prepared on its own).
        options: ``{"threshold", "warmup_steps", "final_dense_steps", "branch_decision"}`` (all optional).
        policy: the runtime policy (unused: EasyCache works in the model's own dtype and device).

    Returns:
        A plan claiming the model's forward (``"<root>"``) and the feature-cache role.

    Raises:
        AccelerationOptionsError: unknown option or invalid value.
        AccelerationRefusedError: streaming inputs, camera/control sub-graphs, offload, torch.compile, CUDA
            graphs, sequence parallelism, another feature cache, approximate attention processors, in-place
            residual updates, training mode, or an unsupported model family (the message names it).
    """
    opts = Options.from_mapping(options)
    check_model(model)
    channels = latent_channels(model)

    def activate() -> EasyCacheHandle:
        handle = EasyCacheHandle(model, opts, channels)
        handle.install(model)
        return handle

    notes = (
        ("threshold 0: every step is computed and the dense output is returned unchanged",)
        if opts.dense
        else ("approximate: reuses the model's input->output transformation on stable steps",)
    )
    return PreparedAcceleration(
        name=PLUGIN_NAME,
        claims=frozenset({ROOT_MODULE, ROLE_FEATURE_CACHE}),
        activate=activate,
        incompatible_with=frozenset({ROLE_OFFLOAD, ROLE_APPROXIMATE_ATTENTION, ROLE_INPLACE_RESIDUAL}),
        options=opts.to_json(),
        exact=True if opts.dense else False,
        notes=notes,
    )


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Register ``easycache``."""
    register(PLUGIN_NAME, prepare, options=Options)
