"""The per-instance ``__call__`` of an accelerated pipeline.

``pipe(...)`` looks ``__call__`` up on the type, so an instance attribute cannot wrap it. Installing gives the
pipeline instance a subclass of its own class (same name, module and qualified name, so ``isinstance``, reprs and
``save_pretrained``'s ``_class_name`` are unchanged) whose ``__call__`` runs the original inside the
acceleration's request scope; uninstalling gives the instance its class back. Copying or pickling the pipeline
while accelerated is refused (the copy would share the original's runtime state): uninstall first.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Final

from worldfoundry.errors import InferenceViewError

#: Instance attribute holding the :class:`~worldfoundry.integrations.diffusers_pipeline.PipelineAcceleration`.
PIPELINE_ATTRIBUTE: Final = "_worldfoundry_accelerations"
BASE_CLASS_ATTRIBUTE: Final = "_worldfoundry_base_class"

_CLASSES: dict[type, type] = {}
_LOCK = threading.Lock()


def accelerated_class(base: type) -> type:
    """The (cached) accelerated subclass of pipeline class ``base``."""
    with _LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            cls = _CLASSES[base] = _make_class(base)
        return cls


def base_class(cls: type) -> type:
    """``cls``'s own pipeline class when ``cls`` is an accelerated subclass, else ``cls``."""
    return cls.__dict__.get(BASE_CLASS_ATTRIBUTE, cls)


def _make_class(base: type) -> type:
    original_call = base.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        accel = self.__dict__.get(PIPELINE_ATTRIBUTE)
        if accel is None or not accel.installed:
            return original_call(self, *args, **kwargs)
        return accel.run_call(functools.partial(original_call, self), args, kwargs)

    functools.update_wrapper(__call__, original_call)

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        raise InferenceViewError(
            f"copying or pickling {base.__name__} is refused while worldfoundry accelerations are installed on it "
            "(the copy would share their runtime state); uninstall first: pipe._worldfoundry_accelerations.uninstall()"
        )

    namespace = {
        "__call__": __call__,
        "__reduce_ex__": __reduce_ex__,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        BASE_CLASS_ATTRIBUTE: base,
    }
    return type(base.__name__, (base,), namespace)


__all__ = ["PIPELINE_ATTRIBUTE", "accelerated_class", "base_class"]
