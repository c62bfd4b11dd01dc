"""Has anything a captured forward depends on changed since the capture? Checked once per model call.

A CUDA graph keeps the addresses of every parameter and buffer it read, and it froze the Python of the forward
it recorded: which modules ran, which hooks fired, which forward a plugin or the user patched in. So a graph is
stale when any parameter or buffer was replaced, edited in place (version counter), moved or cast (data pointer),
or when a submodule was replaced, a module's forward hooks or its patched ``forward`` changed, or the model left
eval mode. (A parameter or submodule *added* changes nothing until a forward uses it — which takes a patched forward
or a hook, both seen.)

:class:`ModelStateWatch` keeps a *generation* number that grows on any such change. The common case (nothing
changed) is a few C-level loops over flat lists built once (identities, version counters, data pointers, hook
counts), no per-module Python. Writes through ``tensor.data`` keep the pointer and bypass the version counter, so
like every fingerprint in the project they are not seen (uninstall and install again after such edits).
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any

import torch.nn as nn
from torch.nn.modules import module as _module_globals

_version = operator.attrgetter("_version")
_data_ptr = operator.methodcaller("data_ptr")
#: Forward hooks only: a graph runs with autograd off, so backward hooks never fire in it.
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")
_GLOBAL_HOOKS = tuple(getattr(_module_globals, name) for name in ("_global_forward_hooks", "_global_forward_pre_hooks")
                      if hasattr(_module_globals, name))


class ModelStateWatch:
    """Generation number of a module tree's tensors, structure, hooks and patched forwards.

    Args:
        model: the module whose forward is captured.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.generation = 0
        self.last_change = ""
        self.versions_seen = True
        self._remember()

    def _remember(self) -> None:
        modules = [m for _, m in self._model.named_modules(remove_duplicate=False)]
        self._tensor_dicts: list[dict[str, Any]] = []
        self._tensor_names: list[str] = []
        for m in modules:
            for d in (m._parameters, m._buffers):
                for name in d:
                    self._tensor_dicts.append(d)
                    self._tensor_names.append(name)
        self._child_dicts = [m._modules for m in modules for _ in m._modules]
        self._child_names = [name for m in modules for name in m._modules]
        self._hook_dicts = [getattr(m, h) for m in modules for h in _HOOK_DICTS] + list(_GLOBAL_HOOKS)
        self._instance_dicts = [m.__dict__ for m in modules]
        self._tensors_now = list(map(dict.get, self._tensor_dicts, self._tensor_names))
        self._tensors = [t for t in self._tensors_now if t is not None]
        self._versions = self._read_versions()
        self.versions_seen = self._versions is not None
        self._ptrs = list(map(_data_ptr, self._tensors))
        self._children = list(map(dict.get, self._child_dicts, self._child_names))
        self._hook_counts = list(map(len, self._hook_dicts))
        self._forwards = list(map(dict.get, self._instance_dicts, repeat("forward")))
        self._training = self._model.training

    def _read_versions(self) -> list[int] | None:
        try:
            return list(map(_version, self._tensors))
        except RuntimeError:  # inference tensors have no version counter: identities and pointers only
            return None

    def check(self) -> int:
        """The current generation (grows by one when anything watched changed since the last check)."""
        change = self._change()
        if change:
            self.generation += 1
            self.last_change = change
            self._remember()
        return self.generation

    def _change(self) -> str:
        if not all(map(operator.is_, map(dict.get, self._child_dicts, self._child_names), self._children)):
            return "a submodule was replaced"
        if not all(map(operator.is_, map(dict.get, self._tensor_dicts, self._tensor_names), self._tensors_now)):
            return "a parameter or buffer was replaced"
        if self._versions is not None and self._read_versions() != self._versions:
            return "a parameter or buffer was edited in place"
        if list(map(_data_ptr, self._tensors)) != self._ptrs:
            return "a parameter or buffer was moved or cast"
        if list(map(len, self._hook_dicts)) != self._hook_counts:
            return "module hooks were added or removed"
        if not all(map(operator.is_, map(dict.get, self._instance_dicts, repeat("forward")), self._forwards)):
            return "a module forward was patched or restored"
        if self._model.training != self._training:
            return "the model's training flag changed"
        return ""


__all__ = ["ModelStateWatch"]
