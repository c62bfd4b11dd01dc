"""A cheap structural snapshot of a module tree: the installer's safety net behind every plugin's own undo.

It holds references only (no tensor copies): each module's instance ``__dict__`` entries, its parameter /
buffer / child / hook dictionaries, and for every parameter and buffer the dtype, shape and device of
its data. :meth:`ModuleTreeSnapshot.restore` puts the structure back exactly; tensor *contents* that were
changed in place cannot be restored from references and are reported instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

_CONTAINERS = (
    "_parameters",
    "_buffers",
    "_modules",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_always_called",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _tensor_key(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    if t is None:
        return None
    # Storage addresses are not compared: a plugin may legitimately restore values into fresh storage.
    return (t.dtype, tuple(t.shape), t.device)


@dataclass
class _ModuleState:
    name: str
    module: nn.Module
    attrs: dict[str, Any]
    containers: dict[str, dict[Any, Any]]
    non_persistent: frozenset[str]
    tensors: dict[str, tuple[Any, ...] | None] = field(default_factory=dict)


class ModuleTreeSnapshot:
    """Snapshot of ``root`` and every submodule (found through ``named_modules``, duplicates included once)."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._states: list[_ModuleState] = []
        for name, module in root.named_modules(remove_duplicate=True):
            attrs = {k: v for k, v in module.__dict__.items() if k not in _CONTAINERS}
            containers = {k: dict(module.__dict__[k]) for k in _CONTAINERS if k in module.__dict__}
            state = _ModuleState(name or "<root>", module, attrs, containers, frozenset(module._non_persistent_buffers_set))
            for kind in ("_parameters", "_buffers"):
                for name, t in module.__dict__[kind].items():
                    state.tensors[f"{kind}.{name}"] = _tensor_key(t)
            self._states.append(state)

    def differences(self) -> list[str]:
        """Human-readable list of what differs from the snapshot now (empty when identical)."""
        diffs: list[str] = []
        for state in self._states:
            where = state.name
            cur_attrs = {k: v for k, v in state.module.__dict__.items() if k not in _CONTAINERS}
            for key in sorted(set(cur_attrs) | set(state.attrs)):
                if key not in state.attrs:
                    diffs.append(f"{where}: attribute {key!r} added")
                elif key not in cur_attrs:
                    diffs.append(f"{where}: attribute {key!r} removed")
                elif cur_attrs[key] is not state.attrs[key]:
                    diffs.append(f"{where}: attribute {key!r} changed")
            for kind, saved in state.containers.items():
                current = state.module.__dict__.get(kind, {})
                if list(current) != list(saved) or any(current[k] is not saved[k] for k in saved if k in current):
                    diffs.append(f"{where}: {kind} changed")
            for kind in ("_parameters", "_buffers"):
                for name, t in state.module.__dict__[kind].items():
                    key = f"{kind}.{name}"
                    if key in state.tensors and _tensor_key(t) != state.tensors[key]:
                        diffs.append(f"{where}: {key[1:]} dtype/shape/device changed")
            if frozenset(state.module._non_persistent_buffers_set) != state.non_persistent:
                diffs.append(f"{where}: non-persistent buffer set changed")
        return diffs

    def restore(self) -> list[str]:
        """Put the module structure back. Returns the differences found before restoring."""
        diffs = self.differences()
        if not diffs:
            return diffs
        for state in self._states:
            module = state.module
            for key in [k for k in module.__dict__ if k not in _CONTAINERS and k not in state.attrs]:
                del module.__dict__[key]
            module.__dict__.update(state.attrs)
            for kind, saved in state.containers.items():
                container = module.__dict__[kind]
                container.clear()
                container.update(saved)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(state.non_persistent)
        return diffs
