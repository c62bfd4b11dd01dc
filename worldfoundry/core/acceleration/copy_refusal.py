"""While accelerations are installed, copying or pickling the model is refused with a clear message.

A copy would carry the plugins' patched forwards, hooks and runtime state (closures over the original model,
locks, derived tensors) and fail with a raw ``cannot pickle '_thread.lock'`` or, worse, share state with the
original. ``copy.deepcopy``, ``pickle`` and ``torch.save(model)`` look ``__deepcopy__`` / ``__reduce_ex__`` up
on the instance first, so a recorded instance attribute refuses them; uninstall removes it and copies work
again. Saving weights (``save_pretrained``, ``state_dict``) is not affected, except by plugins that refuse it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch.nn as nn

from worldfoundry.core.acceleration.handle import RecordedHandle
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.errors import InferenceViewError

COPY_REFUSAL: Final = "copy_refusal"


class _Refuse:
    """Raises the refusal; held as an instance attribute while installed."""

    def __init__(self, model_class: str, names: Sequence[str], action: str) -> None:
        self.message = (
            f"{action} of {model_class} is refused while accelerations {list(names)} are installed (a copy would "
            "carry their patched forwards, hooks and runtime state); uninstall first: "
            "model._worldfoundry_accelerations.uninstall(), or save the weights with save_pretrained()"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise InferenceViewError(self.message)


def refuse_copies(targets: Mapping[str, nn.Module], names: Sequence[str]) -> RecordedHandle:
    """Record ``__deepcopy__`` / ``__reduce_ex__`` refusals on every target.

    Returns:
        A handle whose ``deactivate()`` removes them (a companion of the session).
    """
    with PatchRecorder(COPY_REFUSAL) as rec:
        for module in targets.values():
            model_class = type(module).__name__
            rec.setattr(module, "__deepcopy__", _Refuse(model_class, names, "copy.deepcopy"))
            rec.setattr(module, "__reduce_ex__", _Refuse(model_class, names, "pickling (pickle / torch.save)"))
        patches = rec.pop_all()
    return RecordedHandle(COPY_REFUSAL, patches)


__all__ = ["COPY_REFUSAL", "refuse_copies"]
