"""``PatchRecorder``: every change a plugin makes is recorded and undone in reverse, exactly once.

Plugins never hand-roll undo. Build activation inside ``with PatchRecorder() as rec:`` and call
``rec.pop_all()`` on success (the ExitStack recipe): if anything raises before, the partial change is undone.

Example:
    >>> import torch.nn as nn
    >>> lin = nn.Linear(2, 2)
    >>> with PatchRecorder() as rec:
    ...     rec.wrap_forward(lin, lambda orig: (lambda x: orig(x) * 0), name="zero")
    ...     patches = rec.pop_all()
    >>> patches.undo()
    >>> "forward" in lin.__dict__
    False
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.nn as nn

from worldfoundry.core.acceleration.hook_chain import find_link, splice
from worldfoundry.errors import AccelerationRestoreError, WorldFoundryError

logger = logging.getLogger(__name__)


class _NotSet:
    _instance: _NotSet | None = None

    def __new__(cls) -> _NotSet:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOTSET"


#: Sentinel for "the attribute did not exist before".
NOTSET: Final = _NotSet()

PATCH_NAME_ATTRIBUTE = "_worldfoundry_patch_name"


class DuplicatePatchError(WorldFoundryError, ValueError):
    """A named patch is applied twice to the same target."""


@dataclass
class _Entry:
    description: str
    undo: Callable[[], None]
    #: ``(id(target), name)`` of the slot the entry changed (``None`` for hooks and callbacks)
    key: tuple[int, str] | None = None
    #: returns ``None`` while the change is still in place, else what was put on top of it since
    check: Callable[[], str | None] | None = None
    #: a parameter / buffer / tensor slot: a value put there since replaces ours (nothing of ours is left to
    #: undo), so it is kept, not a collision
    tensor_slot: bool = False


def _slot_of(obj: Any, name: str) -> tuple[str, Any]:
    """Where ``name`` lives on ``obj`` and its current value: parameter / buffer / module / dict / NOTSET."""
    if isinstance(obj, nn.Module):
        if name in obj._parameters:
            return "parameter", obj._parameters[name]
        if name in obj._buffers:
            return "buffer", obj._buffers[name]
        if name in obj._modules:
            return "module", obj._modules[name]
    if name in getattr(obj, "__dict__", {}):
        return "dict", obj.__dict__[name]
    return "absent", NOTSET


def patch_names(fn: Any) -> list[str]:
    """Names of worldfoundry patches wrapped around a callable (outermost first)."""
    names = []
    while fn is not None:
        name = getattr(fn, PATCH_NAME_ATTRIBUTE, None)
        if name is not None:
            names.append(name)
        fn = getattr(fn, "__wrapped__", None)
    return names


class PatchRecorder:
    """Records reversible changes; :meth:`undo` reverts them in reverse order (idempotent)."""

    def __init__(self, label: str = "") -> None:
        self.label = label
        self._entries: list[_Entry] = []
        self._kept: set[tuple[int, str]] = set()

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> PatchRecorder:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Undo whatever was not handed over with pop_all(). Errors during undo are chained onto the original.
        self.undo()

    def pop_all(self) -> PatchRecorder:
        """Move every recorded entry to a new recorder (returned) so leaving the ``with`` block keeps them."""
        new = PatchRecorder(self.label)
        new._entries, self._entries = self._entries, []
        new._kept, self._kept = self._kept, set()
        return new

    def __len__(self) -> int:
        return len(self._entries)

    def descriptions(self) -> list[str]:
        return [e.description for e in self._entries]

    # ------------------------------------------------------------------ primitives
    def callback(self, undo: Callable[[], None], description: str = "callback", *,
                 check: Callable[[], str | None] | None = None) -> None:
        """Record an arbitrary undo callable (for changes the other methods do not cover).

        Args:
            undo: reverts the change.
            description: for logs and collision messages.
            check: optional; returns ``None`` while the change is still in place, else a description of what was
                changed on top of it since (uninstall then refuses before undoing anything).
        """
        self._entries.append(_Entry(description, undo, None, check))

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name = value`` (parameters, buffers and submodules keep their slot and order)."""
        slot, old = _slot_of(obj, name)
        if slot == "parameter":
            if value is not None and not isinstance(value, nn.Parameter):
                raise TypeError(f"{name!r} is a parameter; assign an nn.Parameter (or None), not {type(value).__name__}")
            obj._parameters[name] = value
        elif slot == "buffer":
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{name!r} is a buffer; assign a tensor")
            obj._buffers[name] = value
        elif slot == "module":
            if value is not None and not isinstance(value, nn.Module):
                raise TypeError(f"{name!r} is a submodule; assign an nn.Module")
            obj._modules[name] = value
        elif slot == "dict":
            obj.__dict__[name] = value
        else:
            setattr(obj, name, value)

        def undo(obj: Any = obj, name: str = name, slot: str = slot, old: Any = old) -> None:
            if name == "forward" and _slot_of(obj, name)[1] is not value and splice(obj, value, old, NOTSET):
                return  # a hook added since sits on our forward: keep it, put the original under it
            if slot == "parameter":
                obj._parameters[name] = old
            elif slot == "buffer":
                obj._buffers[name] = old
            elif slot == "module":
                obj._modules[name] = old
            elif slot == "dict":
                obj.__dict__[name] = old
            else:
                _delete_attribute(obj, name)

        self._entries.append(_Entry(f"setattr {type(obj).__name__}.{name}", undo, (id(obj), name),
                                    _still(obj, name, value),
                                    slot in ("parameter", "buffer") or isinstance(value, torch.Tensor)))

    def delattr(self, obj: Any, name: str) -> None:
        """Delete an attribute, remembering where it lived."""
        slot, old = _slot_of(obj, name)
        if slot == "absent":
            raise AttributeError(f"{type(obj).__name__} has no instance attribute {name!r} to delete")
        if isinstance(obj, nn.Module):
            container = {"parameter": obj._parameters, "buffer": obj._buffers, "module": obj._modules}.get(slot)
        else:
            container = None
        if container is not None:
            keys = list(container)
            index = keys.index(name)
            persistent = not (slot == "buffer" and name in obj._non_persistent_buffers_set)
            del container[name]
            if slot == "buffer":
                obj._non_persistent_buffers_set.discard(name)

            def undo() -> None:
                _reinsert(container, name, old, index)
                if slot == "buffer" and not persistent:
                    obj._non_persistent_buffers_set.add(name)
        else:
            del obj.__dict__[name]

            def undo() -> None:
                obj.__dict__[name] = old

        self._entries.append(_Entry(f"delattr {type(obj).__name__}.{name}", undo, (id(obj), name),
                                    _still(obj, name, NOTSET), slot in ("parameter", "buffer")))

    def replace_module(self, parent: nn.Module, name: str, new: nn.Module) -> nn.Module:
        """Swap child ``name`` of ``parent`` for ``new`` in place (order kept). Returns the old child."""
        if name not in parent._modules:
            raise KeyError(f"{type(parent).__name__} has no child module {name!r}")
        old = parent._modules[name]
        self.setattr(parent, name, new)
        return old

    def add_module(self, parent: nn.Module, name: str, module: nn.Module) -> None:
        """Add a new child module (refuses to overwrite)."""
        if _slot_of(parent, name)[0] != "absent":
            raise ValueError(f"{type(parent).__name__} already has an attribute {name!r}")
        parent.add_module(name, module)
        self._entries.append(_Entry(f"add_module {name}", lambda: _delete_attribute(parent, name), (id(parent), name),
                                    _still(parent, name, module)))

    def register_buffer(self, module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = False) -> None:
        """Add a buffer (non-persistent by default so state dicts keep their keys)."""
        if _slot_of(module, name)[0] != "absent":
            raise ValueError(f"{type(module).__name__} already has an attribute {name!r}")
        module.register_buffer(name, tensor, persistent=persistent)

        def undo() -> None:
            module._buffers.pop(name, None)
            module._non_persistent_buffers_set.discard(name)

        self._entries.append(_Entry(f"register_buffer {name}", undo, (id(module), name), _still(module, name, tensor),
                                    True))

    def register_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if _slot_of(module, name)[0] != "absent":
            raise ValueError(f"{type(module).__name__} already has an attribute {name!r}")
        module.register_parameter(name, param)
        self._entries.append(_Entry(f"register_parameter {name}", lambda: module._parameters.pop(name, None),
                                    (id(module), name), _still(module, name, param), True))

    def hook(self, handle: Any, description: str = "hook") -> Any:
        """Record a ``torch.utils.hooks.RemovableHandle`` (removed on undo). Returns the handle."""
        self._entries.append(_Entry(description, handle.remove))
        return handle

    def wrap_forward(self, module: nn.Module, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]],
                     *, name: str) -> Callable[..., Any]:
        """Replace ``module.forward`` with ``make_wrapper(original_forward)``.

        The wrapper keeps the original's signature (``functools.update_wrapper``) and carries ``name``;
        wrapping twice with the same name raises :class:`DuplicatePatchError`.
        """
        original = module.forward
        if name in patch_names(original):
            raise DuplicatePatchError(f"forward of {type(module).__name__} is already patched by {name!r}")
        wrapper = make_wrapper(original)
        functools.update_wrapper(wrapper, original)
        setattr(wrapper, PATCH_NAME_ATTRIBUTE, name)
        self.setattr(module, "forward", wrapper)
        return wrapper

    # ------------------------------------------------------------------ ownership
    def collisions(self, seen: set[tuple[int, str]] | None = None,
                   kept: dict[tuple[int, str], str] | None = None) -> list[str]:
        """What was changed on top of this recorder's changes since they were made (empty: undo is safe).

        Entries are visited in undo order. A slot already in ``seen`` was set again by a later entry (of this
        recorder or of a recorder visited before, sharing ``seen``): undoing that later entry puts back exactly
        what this entry set, so only the last change of every slot is checked. A parameter / buffer slot that
        holds someone else's tensor now is not a collision: nothing of ours is left there, and the new value is
        kept (its key goes to ``kept``; :meth:`keep` then makes :meth:`undo` leave the slot alone).

        Args:
            seen: slot keys already visited; updated in place (pass one set across recorders, newest first).
            kept: filled with ``{slot key: description}`` of the slots to leave as they are.

        Returns:
            One description per collision, e.g. ``"setattr Linear.forward: Linear.forward was replaced ..."``.
        """
        seen = set() if seen is None else seen
        found: list[str] = []
        for entry in reversed(self._entries):
            if entry.key is not None:
                if entry.key in seen:
                    continue
                seen.add(entry.key)
            problem = entry.check() if entry.check is not None else None
            if problem is None:
                continue
            if entry.tensor_slot and entry.key is not None:
                if kept is not None:
                    kept[entry.key] = f"{entry.description}: {problem} (kept)"
                continue
            found.append(f"{entry.description}: {problem}")
        return found

    def keep(self, keys: set[tuple[int, str]] | frozenset[tuple[int, str]]) -> None:
        """Leave these slots as they are on :meth:`undo` (someone else's value replaced ours there)."""
        self._kept |= {e.key for e in self._entries if e.key in keys}

    # ------------------------------------------------------------------ undo
    def undo(self) -> None:
        """Undo every entry in reverse. Continues past failures, then raises :class:`AccelerationRestoreError`."""
        errors: list[BaseException] = []
        while self._entries:
            entry = self._entries.pop()
            if entry.key is not None and entry.key in self._kept:
                continue
            try:
                entry.undo()
            except Exception as exc:
                logger.error("undo of %r failed: %s", entry.description, exc)
                errors.append(exc)
        if errors:
            raise AccelerationRestoreError(errors)


def _still(obj: Any, name: str, value: Any) -> Callable[[], str | None]:
    """A check that ``obj.name`` still holds ``value`` (``NOTSET``: still absent)."""

    def check() -> str | None:
        _, current = _slot_of(obj, name)
        if current is value:
            return None
        if name == "forward" and value is not NOTSET and find_link(obj, value) is not None:
            return None  # a diffusers / accelerate hook wraps our forward: undo splices the original under it
        if value is NOTSET:
            return f"{type(obj).__name__}.{name} was added since install"
        if current is NOTSET:
            return f"{type(obj).__name__}.{name} was removed since install"
        return f"{type(obj).__name__}.{name} was replaced since install (now {_short(current)})"

    return check


def _short(value: Any) -> str:
    text = getattr(value, "__qualname__", None) or type(value).__name__
    return str(text)[:80]


def _delete_attribute(obj: Any, name: str) -> None:
    if isinstance(obj, nn.Module):
        for container in (obj._parameters, obj._buffers, obj._modules):
            if name in container:
                del container[name]
                if container is obj._buffers:
                    obj._non_persistent_buffers_set.discard(name)
                return
    if name in getattr(obj, "__dict__", {}):
        del obj.__dict__[name]
    elif hasattr(obj, name):
        delattr(obj, name)


def _reinsert(container: dict[str, Any], name: str, value: Any, index: int) -> None:
    items = list(container.items())
    items.insert(min(index, len(items)), (name, value))
    container.clear()
    container.update(items)
