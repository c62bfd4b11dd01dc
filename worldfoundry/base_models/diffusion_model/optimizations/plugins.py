"""Public plugin API (stable names).

Example:
    >>> from worldfoundry.base_models.diffusion_model.optimizations.plugins import (
    ...     diffusion_acceleration_registry, install_diffusion_accelerations, PreparedAcceleration)
"""

from __future__ import annotations

from worldfoundry.core.acceleration.context import RequestContext, current_request, request_scope
from worldfoundry.core.acceleration.guard import RequestGuard, attach_request_guard, get_request_guard
from worldfoundry.core.acceleration.handle import RecordedHandle
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.patching import NOTSET, PatchRecorder
from worldfoundry.core.acceleration.prepared import (
    ROOT_MODULE,
    AccelerationHandle,
    PreparedAcceleration,
    PrepareFactory,
    role,
)
from worldfoundry.core.acceleration.receipts import ExecutionLedger, InstallReceipt
from worldfoundry.core.acceleration.registry import (
    AccelerationRegistry,
    RegisteredAcceleration,
    diffusion_acceleration_registry,
)
from worldfoundry.core.acceleration.session import AccelerationSession, get_session, runtime_optimization_report

__all__ = [
    "NOTSET",
    "ROOT_MODULE",
    "AccelerationHandle",
    "AccelerationRegistry",
    "AccelerationSession",
    "ExecutionLedger",
    "InstallReceipt",
    "PatchRecorder",
    "PrepareFactory",
    "PreparedAcceleration",
    "RecordedHandle",
    "RegisteredAcceleration",
    "RequestContext",
    "RequestGuard",
    "attach_request_guard",
    "current_request",
    "diffusion_acceleration_registry",
    "get_request_guard",
    "get_session",
    "install_diffusion_accelerations",
    "request_scope",
    "role",
    "runtime_optimization_report",
]
