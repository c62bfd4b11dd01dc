"""worldfoundry-lightvae: the LightVAE Wan2.1 student codec variant and its calibrated FP8 encoder.

The codec loader lives in worldfoundry itself; it is re-exported here for convenience:

    >>> from worldfoundry_lightvae import load_wan_video_codec, codec_from_component_options  # doctest: +SKIP
"""

from __future__ import annotations

from worldfoundry.base_models.diffusion_model.codec import (
    WanVideoCodec,
    codec_from_component_options,
    load_wan_video_codec,
)
from worldfoundry.base_models.diffusion_model.codec_checkpoints import STUDENT_VARIANT
from worldfoundry_lightvae.options import PLUGIN_NAME, Options

__version__ = "0.1.0"

__all__ = [
    "PLUGIN_NAME",
    "STUDENT_VARIANT",
    "Options",
    "WanVideoCodec",
    "codec_from_component_options",
    "load_wan_video_codec",
]
