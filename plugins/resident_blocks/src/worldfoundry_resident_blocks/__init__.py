"""resident_blocks for worldfoundry: DiT block weights on the host, r resident blocks per request, two slots."""

from __future__ import annotations

from worldfoundry_resident_blocks.options import NAME, Options

__all__ = ["NAME", "Options"]
