"""worldfoundry: pluggable, reversible, verifiable inference accelerations for video diffusion transformers."""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

#: Marker for plugin hook implementations (``@worldfoundry.hookimpl``).
hookimpl = pluggy.HookimplMarker("worldfoundry")

__all__ = ["__version__", "hookimpl"]
