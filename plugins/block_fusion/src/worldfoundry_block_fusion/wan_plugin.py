"""Registration and ``prepare`` of ``wan_block_fusion`` (diffusers ``WanTransformer3DModel``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.nn as nn

import worldfoundry
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.plugin import PreparedAcceleration
from worldfoundry_block_fusion.options import WAN_NAME, WanOptions
from worldfoundry_block_fusion.planning import activate_plan, kernel_note, plan_blocks
from worldfoundry_block_fusion.wan_block import WanBlockRuntime


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Called once by the registry when it discovers this entry point."""
    register(WAN_NAME, prepare, options=WanOptions)


def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy | None = None) -> PreparedAcceleration:
    """Validate ``options`` against ``model``; change nothing.

    Claims every fused block (``blocks.<i>``): its forward is replaced, and with the ``rope`` chain its
    ``attn1`` processor too. Plugins that replace whole blocks (``resident_blocks``) conflict on those paths.

    Raises:
        AccelerationOptionsError: unknown/invalid options.
        AccelerationRefusedError: see :func:`~worldfoundry_block_fusion.planning.plan_blocks`.
    """
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor, WanTransformerBlock

    opts = WanOptions.from_mapping(options)
    plan = plan_blocks(model, opts, name=WAN_NAME, family="wan", block_class=WanTransformerBlock,
                       processor_class=WanAttnProcessor, replace_processor="rope" in opts.chains)
    fused = sorted(opts.chains)
    return PreparedAcceleration(
        name=WAN_NAME,
        claims=plan.claims(),
        activate=lambda: activate_plan(plan, opts, lambda counters: WanBlockRuntime(
            counters, opts.chains, opts.min_tokens, list(plan.blocks))),
        options=opts.to_json(),
        exact=True,
        notes=(f"fused chains: {', '.join(fused)}; "
               + ("LayerNorm in the kernels (PyTorch's CUDA algorithm reproduced; CPU calls run the norm modules); "
                  "RMSNorm, attention, GEMMs and GELU stay torch calls" if "layer_norm" in opts.chains
                  else "LayerNorm/RMSNorm, attention, GEMMs and GELU stay torch calls"),
               "bitwise to eager: the same operations in the same precision and order, no FMA contraction",
               kernel_note()),
    )


__all__ = ["prepare", "register_diffusion_accelerations"]
