"""Accelerations on the diffusers pipelines users already have (``WanPipeline``, ``SanaVideoPipeline``, ...).

``worldfoundry.accelerate(pipe, spec)`` (or ``install_diffusion_accelerations(pipe, spec)``) installs on every
DiT of the pipeline and gives each ``pipe(...)`` call a request scope; see ``docs/diffusers.md``.
"""

from __future__ import annotations

from worldfoundry.integrations.diffusers_pipeline.acceleration import (
    MAX_CALL_RECEIPTS,
    PipelineAcceleration,
    PipelineCallReceipt,
    accelerate_pipeline,
)
from worldfoundry.integrations.diffusers_pipeline.components import DIT_COMPONENTS, pipeline_dits

__all__ = [
    "DIT_COMPONENTS",
    "MAX_CALL_RECEIPTS",
    "PipelineAcceleration",
    "PipelineCallReceipt",
    "accelerate_pipeline",
    "pipeline_dits",
]
