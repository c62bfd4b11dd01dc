"""Registration and ``prepare`` of ``sana_block_fusion`` (diffusers ``SanaVideoTransformer3DModel``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.nn as nn

import worldfoundry
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.plugin import PreparedAcceleration
from worldfoundry_block_fusion.options import SANA_NAME, SanaOptions
from worldfoundry_block_fusion.planning import activate_plan, kernel_note, plan_blocks
from worldfoundry_block_fusion.sana_block import SanaBlockRuntime


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Called once by the registry when it discovers this entry point."""
    register(SANA_NAME, prepare, options=SanaOptions)


def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy | None = None) -> PreparedAcceleration:
    """Validate ``options`` against ``model``; change nothing.

    Claims every fused block (``transformer_blocks.<i>``); with ``linear_attention`` its ``attn1`` processor is
    replaced too, with ``glu`` its feed-forward's (``GLUMBTempConv``) forward.

    Raises:
        AccelerationOptionsError: unknown/invalid options.
        AccelerationRefusedError: see :func:`~worldfoundry_block_fusion.planning.plan_blocks`.
    """
    from diffusers.models.transformers.transformer_sana_video import (
        GLUMBTempConv,
        SanaLinearAttnProcessor3_0,
        SanaVideoTransformerBlock,
    )

    opts = SanaOptions.from_mapping(options)
    plan = plan_blocks(model, opts, name=SANA_NAME, family="sana_video", block_class=SanaVideoTransformerBlock,
                       processor_class=SanaLinearAttnProcessor3_0,
                       replace_processor="linear_attention" in opts.chains,
                       ff_class=GLUMBTempConv if "glu" in opts.chains else None)
    return PreparedAcceleration(
        name=SANA_NAME,
        claims=plan.claims(),
        activate=lambda: activate_plan(plan, opts, lambda counters: SanaBlockRuntime(
            counters, opts.chains, opts.min_tokens)),
        options=opts.to_json(),
        exact=True,
        notes=(f"fused chains: {', '.join(sorted(opts.chains))}; LayerNorm/RMSNorm, the key sum, matmuls, "
               "convolutions and the feed-forward's first SiLU stay torch calls",
               "bitwise to eager: the same operations, rounded per operation as eager's bfloat16 arithmetic",
               kernel_note()),
    )


__all__ = ["prepare", "register_diffusion_accelerations"]
