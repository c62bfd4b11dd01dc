"""worldfoundry: pluggable, reversible, verifiable inference accelerations for video diffusion transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Mapping

__version__ = "0.1.0"

#: Marker for plugin hook implementations (``@worldfoundry.hookimpl``).
hookimpl = pluggy.HookimplMarker("worldfoundry")


def accelerate(pipe: Any, spec: Mapping[str, Any], policy: Any = None, **kwargs: Any) -> Any:
    """Install accelerations on a diffusers pipeline (or a model), reversibly.

    Short for :func:`~worldfoundry.core.acceleration.installer.install_diffusion_accelerations`.

    Args:
        pipe: a diffusers ``DiffusionPipeline`` (every DiT of it; a request scope per ``pipe(...)`` call) or a
            diffusers model.
        spec: ``{name: options mapping or True}``.
        policy: optional ``RuntimePolicy`` (default: the model's device and dtype).
        **kwargs: ``registry=`` to look names up elsewhere than the process default.

    Returns:
        A ``PipelineAcceleration`` for a pipeline, an ``AccelerationSession`` for a model; ``.uninstall()``
        undoes exactly what was installed.

    Example:
        >>> import worldfoundry
        >>> accel = worldfoundry.accelerate(pipe, {"wan_cross_kv_fusion": {}})  # doctest: +SKIP
        >>> accel.uninstall()                                                    # doctest: +SKIP
    """
    from worldfoundry.core.acceleration.installer import install_diffusion_accelerations

    return install_diffusion_accelerations(pipe, spec, policy, **kwargs)


__all__ = ["__version__", "accelerate", "hookimpl"]

# The model layer's runtime options are declared on import of the package, so a ``RuntimePolicy`` built before
# any model-layer import accepts them (the declarations import no torch).
from worldfoundry.base_models import runtime_options as _runtime_options  # noqa: E402,F401
