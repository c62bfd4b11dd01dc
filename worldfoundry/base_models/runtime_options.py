"""What the model layer hands down to core on import: the runtime options it reads (declared, so a
``RuntimePolicy`` accepts and checks them) and the component classes of its own that recipes may name.

Core validates the options generically (name + check); what they mean lives here and where they are consumed.
Nothing here imports torch: the class is imported only when a recipe names it.
"""

from __future__ import annotations

from typing import Final

from worldfoundry.core.model_loading.class_allowlist import register_project_class
from worldfoundry.core.model_loading.runtime_options import declare_runtime_option, file_path

#: The video codec's FP8 encoder calibration artifact (consumed by ``diffusion_model/codec.py``).
VAE_FP8_CALIBRATION: Final = "vae_fp8_calibration"

#: Every runtime option key the model layer declares.
MODEL_LAYER_OPTION_KEYS: Final[frozenset[str]] = frozenset({VAE_FP8_CALIBRATION})

declare_runtime_option(VAE_FP8_CALIBRATION, file_path,
                       doc="path of the video codec's FP8 encoder calibration artifact (read by the codec)")

#: The model layer's component classes that recipes may name: reference -> (module, class).
MODEL_LAYER_CLASSES: Final[dict[str, tuple[str, str]]] = {
    "worldfoundry.base_models.diffusion_model.patch_codec.PixelPatchCodec": (
        "worldfoundry.base_models.diffusion_model.patch_codec", "PixelPatchCodec"),
}
for _reference, (_module, _attribute) in MODEL_LAYER_CLASSES.items():
    register_project_class(_reference, _module, _attribute)
