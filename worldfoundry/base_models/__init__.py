"""The model layer: native pipelines and their components. Importing it declares its runtime options to core."""

from __future__ import annotations

from worldfoundry.base_models import runtime_options as _runtime_options  # noqa: F401  (declares the options)
