"""Runtime options the model layer reads, declared to core so a ``RuntimePolicy`` accepts and checks them.

Core validates these generically (name + check); what they mean lives here and where they are consumed.
"""

from __future__ import annotations

from typing import Final

from worldfoundry.core.model_loading.runtime_options import declare_runtime_option, file_path

#: The video codec's FP8 encoder calibration artifact (consumed by ``diffusion_model/codec.py``).
VAE_FP8_CALIBRATION: Final = "vae_fp8_calibration"

#: Every runtime option key the model layer declares.
MODEL_LAYER_OPTION_KEYS: Final[frozenset[str]] = frozenset({VAE_FP8_CALIBRATION})

declare_runtime_option(VAE_FP8_CALIBRATION, file_path,
                       doc="path of the video codec's FP8 encoder calibration artifact (read by the codec)")
