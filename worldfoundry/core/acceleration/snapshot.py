"""A cheap structural snapshot of a module tree: a detector behind every plugin's own undo.

It holds references only (no tensor copies): each module's instance ``__dict__`` entries, its parameter /
buffer / child / hook dictionaries, and for every parameter and buffer the dtype, shape and device of
its data. On uninstall it only *detects* (:func:`leftovers`: what install changed and nobody undid); it never
puts back state, because anything changed after install belongs to whoever changed it. Only a failed install,
which held the model exclusively, is rolled back with :meth:`ModuleTreeSnapshot.restore`.
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

    def changes(self) -> dict[tuple[str, ...], str]:
        """What differs from the snapshot now, keyed by slot: ``(module, "attr", name)``,
        ``(module, container, key)``, ``(module, "tensor", kind.name)`` or ``(module, "non_persistent")``.

        Returns:
            ``{slot key: human-readable description}`` (empty when identical).
        """
        found: dict[tuple[str, ...], str] = {}
        for state in self._states:
            where = state.name
            cur_attrs = {k: v for k, v in state.module.__dict__.items() if k not in _CONTAINERS}
            for key in sorted(set(cur_attrs) | set(state.attrs)):
                if key not in state.attrs:
                    found[(where, "attr", key)] = f"{where}: attribute {key!r} added"
                elif key not in cur_attrs:
                    found[(where, "attr", key)] = f"{where}: attribute {key!r} removed"
                elif cur_attrs[key] is not state.attrs[key]:
                    found[(where, "attr", key)] = f"{where}: attribute {key!r} changed"
            for kind, saved in state.containers.items():
                current = state.module.__dict__.get(kind, {})
                for k in list(saved) + [k for k in current if k not in saved]:
                    if k not in current or k not in saved or current[k] is not saved[k]:
                        found[(where, kind, str(k))] = f"{where}: {kind} changed ({k!r})"
                if list(current) != list(saved) and not any(key[:2] == (where, kind) for key in found):
                    found[(where, kind, "<order>")] = f"{where}: {kind} changed (order)"
            for kind in ("_parameters", "_buffers"):
                for name, t in state.module.__dict__[kind].items():
                    key = f"{kind}.{name}"
                    if key in state.tensors and _tensor_key(t) != state.tensors[key]:
                        found[(where, "tensor", key)] = f"{where}: {key[1:]} dtype/shape/device changed"
            if frozenset(state.module._non_persistent_buffers_set) != state.non_persistent:
                found[(where, "non_persistent")] = f"{where}: non-persistent buffer set changed"
        return found

    def differences(self) -> list[str]:
        """Human-readable list of what differs from the snapshot now (empty when identical)."""
        return list(self.changes().values())

    def restore(self) -> list[str]:
        """Put the module structure back. Returns the differences found before restoring.

        Only for undoing a failed install (nothing else can have changed the model while the install held it);
        never used on uninstall, where later changes belong to someone else.
        """
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


def repair_leftovers(before: ModuleTreeSnapshot, after: ModuleTreeSnapshot) -> list[str]:
    """Put back, slot by slot, what install changed and uninstall did not undo (see :func:`leftovers`).

    Only slots nobody touched since install are restored: they hold the install's own change. Everything
    changed after install (the user's LoRA, hooks, moves) is left as it is.

    Returns:
        Descriptions of the slots found (and restored where the snapshot holds the old value).
    """
    since_install = after.changes()
    found = {key: text for key, text in before.changes().items() if key not in since_install}
    states = {state.name: state for state in before._states}
    for key in found:
        state = states.get(key[0])
        if state is not None:
            _restore_slot(state, key)
    return list(found.values())


def _restore_slot(state: _ModuleState, key: tuple[str, ...]) -> None:
    module = state.module
    if key[1] == "attr":
        name = key[2]
        if name in state.attrs:
            module.__dict__[name] = state.attrs[name]
        else:
            module.__dict__.pop(name, None)
    elif key[1] in state.containers and key[2] != "<order>":
        saved = state.containers[key[1]]
        container = module.__dict__[key[1]]
        match = next((k for k in saved if str(k) == key[2]), None)
        if match is not None:
            container[match] = saved[match]
        else:
            for k in [k for k in container if str(k) == key[2]]:
                del container[k]
    elif key[1] == "non_persistent":
        module._non_persistent_buffers_set.clear()
        module._non_persistent_buffers_set.update(state.non_persistent)


def leftovers(before: ModuleTreeSnapshot, after: ModuleTreeSnapshot) -> list[str]:
    """What install changed and uninstall did not undo, while nobody else touched it since install.

    Args:
        before: taken before install.
        after: taken right after install.

    Returns:
        Descriptions of slots that differ from ``before`` but not from ``after`` (a plugin's incomplete undo).
        Slots changed after install (the user's LoRA, hooks, moves) differ from ``after`` and are not listed.
    """
    since_install = after.changes()
    return [text for key, text in before.changes().items() if key not in since_install]
