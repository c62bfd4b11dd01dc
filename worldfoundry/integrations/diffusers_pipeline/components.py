"""Which modules of a diffusers pipeline are its DiTs, and the routed schedule of one call.

Wan 2.1 / SANA-Video pipelines have one ``transformer``; Wan 2.2 A14B adds ``transformer_2`` and the pipeline
config's ``boundary_ratio``: ``transformer`` runs the steps with ``t >= boundary_ratio * num_train_timesteps``,
``transformer_2`` the rest (the same comparison the pipeline makes, on the scheduler's own timesteps).
"""

from __future__ import annotations

from typing import Any, Final

import torch.nn as nn

from worldfoundry.core.acceleration.schedule import RequestSchedule
from worldfoundry.core.acceleration.session import SINGLE_MODEL_LABEL
from worldfoundry.errors import AccelerationRefusedError, RequestError

#: Pipeline components that hold a diffusion transformer, in routing order (high noise first).
DIT_COMPONENTS: Final = ("transformer", "transformer_2")


def pipeline_dits(pipe: Any) -> dict[str, nn.Module]:
    """The pipeline's DiTs by session label: ``{"model": transformer}`` for one, else by component name.

    Args:
        pipe: a diffusers ``DiffusionPipeline``.

    Returns:
        Label -> module (``"transformer"`` / ``"transformer_2"`` for a routed pair).

    Raises:
        AccelerationRefusedError: the pipeline has no ``transformer`` / ``transformer_2`` module.
    """
    present = {name: getattr(pipe, name, None) for name in DIT_COMPONENTS}
    present = {name: module for name, module in present.items() if isinstance(module, nn.Module)}
    if not present:
        raise AccelerationRefusedError(
            "pipeline", f"{type(pipe).__name__} has no 'transformer' or 'transformer_2' module to accelerate"
        )
    if len(present) == 1:
        return {SINGLE_MODEL_LABEL: next(iter(present.values()))}
    return present


def boundary_timestep(pipe: Any) -> float | None:
    """``boundary_ratio * num_train_timesteps`` of a routed pipeline, else ``None``."""
    ratio = getattr(getattr(pipe, "config", None), "boundary_ratio", None)
    if ratio is None:
        return None
    return float(ratio) * float(pipe.scheduler.config.num_train_timesteps)


def call_schedule(pipe: Any, labels: list[str]) -> RequestSchedule:
    """The schedule of the call running now, from the scheduler's timesteps (set by the pipeline already).

    Args:
        pipe: the pipeline.
        labels: the session's expert labels (one, or ``["transformer", "transformer_2"]``).

    Returns:
        An immutable :class:`RequestSchedule` (expert per step by the pipeline's boundary).

    Raises:
        RequestError: the scheduler has no timesteps yet.
    """
    timesteps = getattr(pipe.scheduler, "timesteps", None)
    if timesteps is None or len(timesteps) == 0:
        raise RequestError(f"{type(pipe).__name__}: the scheduler has no timesteps when the DiT is first called")
    values = [float(t) for t in timesteps.tolist()]
    boundary = boundary_timestep(pipe)
    if len(labels) == 1:
        experts = [labels[0]] * len(values)
    elif boundary is None:
        experts = [labels[0]] * len(values)
    else:
        high = (timesteps >= boundary).tolist()
        experts = [labels[0] if h else labels[1] for h in high]
    return RequestSchedule.from_steps(values, experts)


__all__ = ["DIT_COMPONENTS", "boundary_timestep", "call_schedule", "pipeline_dits"]
