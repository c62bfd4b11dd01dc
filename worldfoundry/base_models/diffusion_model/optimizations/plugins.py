"""Public plugin API under its first path: a re-export of :mod:`worldfoundry.plugin` plus the user-side names.

New code imports :mod:`worldfoundry.plugin` (plugin authors) or this module's user-side names (registry,
installer, guard, reports); both stay stable.

Example:
    >>> from worldfoundry.base_models.diffusion_model.optimizations.plugins import (
    ...     diffusion_acceleration_registry, install_diffusion_accelerations, PreparedAcceleration, ROLE_OFFLOAD)
"""

from __future__ import annotations

from worldfoundry.core.acceleration.guard import RequestGuard, attach_request_guard, get_request_guard
from worldfoundry.core.acceleration.receipts import InstallReceipt
from worldfoundry.core.acceleration.registry import RegisteredAcceleration, diffusion_acceleration_registry
from worldfoundry.core.acceleration.session import runtime_optimization_report
from worldfoundry.plugin import *  # noqa: F403 - the plugin authors' names, re-exported unchanged
from worldfoundry.plugin import __all__ as _plugin_names

__all__ = [
    *_plugin_names,
    "InstallReceipt",
    "RegisteredAcceleration",
    "RequestGuard",
    "attach_request_guard",
    "diffusion_acceleration_registry",
    "get_request_guard",
    "runtime_optimization_report",
]
