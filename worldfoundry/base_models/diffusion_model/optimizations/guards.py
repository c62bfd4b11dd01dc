"""Fixed-weight lifecycle protection for plugins that keep tensors derived from a model's weights.

While such a plugin is active (selective FP8, SVDQuant), the model is an *inference view*: its derived
tensors (FP8 copies, packed factors) were computed from the weights present at activation. The guard makes
the operations that would break that contract fail loudly with
:class:`~worldfoundry.errors.InferenceViewError` ("uninstall <plugin> first"):

* ``state_dict()`` and ``load_state_dict()`` (saving or loading a canonical checkpoint),
* ``.to()``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.float()``, ``.bfloat16()``, ``.double()``, ``.type()``,
  ``.to_empty()`` and anything else routed through ``Module._apply`` (dtype/device moves),
* ``train()`` / ``train(True)`` (``eval()`` stays allowed),
* assigning a new parameter to a fixed module (``linear.weight = nn.Parameter(...)``).

These are refused on every *guarded module*: the fixed modules and all their ancestors up to the root, so a
call on the whole model is refused before it touches anything. Modules outside those paths are unaffected.

In-place edits of a fixed weight (``weight.copy_(...)``, ``weight.mul_(...)`` under ``no_grad``) and direct
replacement through ``module._parameters`` cannot be intercepted when they happen; :meth:`WeightViewGuard.verify`
detects them (parameter identity and the tensor version counter) and the plugin calls it before every use,
so the next forward refuses instead of running stale derived tensors. Edits through ``weight.data`` bypass the
version counter and are not detected: do not edit weights while a weight-view plugin is active.

Every change is made through a :class:`~worldfoundry.core.acceleration.patching.PatchRecorder`, so
uninstalling removes the guard exactly.

Example:
    >>> import torch.nn as nn
    >>> from worldfoundry.core.acceleration.patching import PatchRecorder
    >>> model = nn.Sequential(nn.Linear(4, 4))
    >>> with PatchRecorder() as rec:
    ...     guard = install_weight_view_guard(rec, model, {"0": model[0]}, plugin="demo")
    ...     patches = rec.pop_all()
    >>> model.state_dict()
    Traceback (most recent call last):
    ...
    worldfoundry.errors.InferenceViewError: state_dict() on the model is refused while demo is active ...
    >>> patches.undo()
    >>> sorted(model.state_dict())
    ['0.bias', '0.weight']
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.errors import InferenceViewError

#: Dtype/device moves refused by name (everything else that reaches ``Module._apply`` is refused there).
MOVE_METHODS: Final = ("to", "cuda", "cpu", "half", "float", "bfloat16", "double", "type", "to_empty")
#: Methods replaced on every guarded module.
GUARDED_METHODS: Final = (
    "state_dict", "load_state_dict", "train", "register_parameter", "_apply", *MOVE_METHODS,
)

_ACTION: Final = {
    "state_dict": "state_dict()",
    "load_state_dict": "load_state_dict()",
    "_apply": "a dtype/device change of its tensors (Module._apply)",
    "train": "train()",
    "register_parameter": "assigning a parameter",
    **{name: f".{name}()" for name in MOVE_METHODS},
}


def _refusal(plugin: str, action: str, where: str) -> InferenceViewError:
    return InferenceViewError(
        f"{action} on {where} is refused while {plugin} is active (the model is an inference view holding "
        f"tensors derived from its weights); uninstall {plugin} first: model._worldfoundry_accelerations.uninstall()"
    )


@dataclass
class _WeightState:
    module: nn.Module
    name: str
    tensor: torch.Tensor
    version: int
    data_ptr: int


class WeightViewGuard:
    """Records the fixed weights and checks them before use. Built by :func:`install_weight_view_guard`."""

    def __init__(self, plugin: str, fixed: Mapping[str, nn.Module]) -> None:
        self.plugin = plugin
        self._states: dict[str, list[_WeightState]] = {}
        for path, module in fixed.items():
            states = []
            for name, param in module.named_parameters(recurse=False):
                states.append(_WeightState(module, name, param, param._version, param.data_ptr()))
            self._states[path] = states

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(self._states)

    def changed(self, path: str) -> str | None:
        """A description of how ``path``'s parameters changed since activation, or ``None``.

        Args:
            path: a fixed module path.

        Returns:
            ``None`` when unchanged, else e.g. ``"weight was edited in place"``.
        """
        for state in self._states.get(path, ()):
            current = state.module._parameters.get(state.name)
            if current is not state.tensor:
                return f"{state.name} was replaced"
            if current._version != state.version or current.data_ptr() != state.data_ptr:
                return f"{state.name} was edited in place"
        return None

    def verify(self, path: str) -> None:
        """Raise when ``path``'s parameters changed since activation.

        Raises:
            InferenceViewError: naming the module and what changed.
        """
        change = self.changed(path)
        if change is not None:
            raise InferenceViewError(
                f"{path}.{change} while {self.plugin} is active; its derived tensors are stale. "
                f"Undo the edit or uninstall {self.plugin} first, then apply the edit and install again"
            )


def _guarded_paths(model: nn.Module, fixed: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """The fixed modules and every ancestor (``""`` is the root)."""
    by_name = dict(model.named_modules())
    guarded: dict[str, nn.Module] = {"": model}
    for path in fixed:
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in by_name:
                raise KeyError(f"{path!r} is not a module path of the model")
            guarded[prefix] = by_name[prefix]
    return guarded


def _make_refusing(original: Callable[..., Any], plugin: str, action: str, where: str,
                   allow: Callable[..., bool] | None = None) -> Callable[..., Any]:
    def refusing(*args: Any, **kwargs: Any) -> Any:
        if allow is not None and allow(*args, **kwargs):
            return original(*args, **kwargs)
        raise _refusal(plugin, action, where)

    functools.update_wrapper(refusing, original)
    return refusing


def _train_allowed(mode: bool = True) -> bool:
    return not mode


def install_weight_view_guard(
    recorder: PatchRecorder, model: nn.Module, fixed: Mapping[str, nn.Module], *, plugin: str
) -> WeightViewGuard:
    """Protect ``fixed`` modules (and their ancestors) of ``model`` while ``plugin`` is active.

    Args:
        recorder: where the method replacements are recorded (undone with the plugin's other patches).
        model: the root model.
        fixed: ``{path: module}`` whose weights the plugin derived tensors from.
        plugin: the plugin name used in messages ("uninstall <plugin> first").

    Returns:
        A :class:`WeightViewGuard` whose :meth:`~WeightViewGuard.verify` the plugin calls before using the
        derived tensors of a module.

    Raises:
        KeyError: a path in ``fixed`` is not a module of ``model``.
    """
    guard = WeightViewGuard(plugin, fixed)
    for path, module in _guarded_paths(model, fixed).items():
        where = "the model" if path == "" else f"module {path!r}"
        for method in GUARDED_METHODS:
            original = getattr(module, method)
            allow = _train_allowed if method == "train" else None
            recorder.setattr(module, method, _make_refusing(original, plugin, _ACTION[method], where, allow))
    return guard


def install_call_refusals(recorder: PatchRecorder, module: nn.Module, methods: Mapping[str, str], *, plugin: str,
                          where: str = "the model") -> list[str]:
    """Refuse calls of ``module``'s methods while ``plugin`` is active, each with the reason given.

    For diffusers features that would break the plugin at the next forward (``enable_layerwise_casting`` under
    packed or offloaded weights): the call itself fails, naming both sides, and nothing changes.

    Args:
        recorder: where the replacements are recorded (undone with the plugin's other patches).
        module: the model (or submodule) whose methods are refused.
        methods: ``{method name: why it cannot run beside the plugin}``; names the module lacks are skipped.
        plugin: the plugin name used in messages.
        where: how the messages name ``module``.

    Returns:
        The method names refused.
    """
    refused = []
    for method, reason in methods.items():
        original = getattr(module, method, None)
        if not callable(original):
            continue
        action = f"{method}() ({reason})"
        recorder.setattr(module, method, _make_refusing(original, plugin, action, where))
        refused.append(method)
    return refused


def install_move_guard(recorder: PatchRecorder, model: nn.Module, modules: Mapping[str, nn.Module], *,
                       plugin: str) -> None:
    """Refuse dtype/device moves of ``model`` and of ``modules`` (and their ancestors) while ``plugin`` is active.

    For plugins that keep weights in a place of their own (offload masters on the host): a move would go
    around them, and uninstall afterwards could not give back a consistent model. The message says
    "uninstall <plugin> first".

    Raises:
        KeyError: a path in ``modules`` is not a module of ``model``.
    """
    for path, module in _guarded_paths(model, modules).items():
        where = "the model" if path == "" else f"module {path!r}"
        for method in ("_apply", *MOVE_METHODS):
            original = getattr(module, method)
            recorder.setattr(module, method, _make_refusing(original, plugin, _ACTION[method], where))


__all__ = ["GUARDED_METHODS", "WeightViewGuard", "install_call_refusals", "install_move_guard",
           "install_weight_view_guard"]
