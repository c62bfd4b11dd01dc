"""Hook specifications for plugin distributions.

A plugin distribution declares an entry point in the group ``worldfoundry.accelerations`` (acceleration
plugins) or ``worldfoundry.attention_providers`` (attention kernels) that names a module containing
``@worldfoundry.hookimpl`` functions. The registry calls each one with a ``register``
callback instead of letting plugins touch global state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import pluggy

PROJECT_NAME: Final = "worldfoundry"
ACCELERATION_ENTRY_POINT_GROUP: Final = "worldfoundry.accelerations"
ATTENTION_PROVIDER_ENTRY_POINT_GROUP: Final = "worldfoundry.attention_providers"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Register accelerations provided by this plugin.

    Args:
        register: ``register(name, prepare_factory, *, options=Options, replace=False)``.
            ``prepare_factory(model, options, policy)`` validates and returns a
            :class:`~worldfoundry.core.acceleration.prepared.PreparedAcceleration`; ``Options`` (a
            :class:`~worldfoundry.plugin.PluginOptions` subclass) lets tools validate a spec without a model.
    """


@hookspec
def register_attention_providers(register: Callable[..., None]) -> None:
    """Register attention providers offered by this distribution.

    Args:
        register: ``register(provider, *, replace=False)`` with an
            :class:`~worldfoundry.core.attention.providers.AttentionProvider`.
    """
