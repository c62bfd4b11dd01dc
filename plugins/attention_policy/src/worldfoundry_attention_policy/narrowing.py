"""The SDPA interception entered around diffusers' dispatcher call only, not around the whole attention module.

A :class:`torch.overrides.TorchFunctionMode` active over an attention module's forward puts Python in front of every
torch operation of the module (projections, norms, reshapes, casts); on an H200 at W17 that measured about 0.5 ms
per attention call. The interception is needed only for the SDPA call inside ``dispatch_attention_fn``. So for a
processor that resolves ``dispatch_attention_fn`` as a module global at call time (every stock diffusers 0.42
processor does; a processor may also name that module as its ``dispatch_namespace`` attribute), the module's
``dispatch_attention_fn`` is replaced, while at least one installed ``attention_policy`` uses it, by a pass-through:
it enters the interception pending for the current thread (a :class:`contextvars.ContextVar` set by the wrapped
module forward) around the dispatcher call alone, and with nothing pending calls the dispatcher directly. The last
release puts the original back if nobody replaced it since (a later replacement is left as it is; ours underneath
it stays a pass-through).

A processor that reaches the dispatcher some other way is detected: a routed call that ends without the
interception having been entered ran PyTorch SDPA; the caller counts it as a fallback
(:data:`REASON_NOT_REACHED`) and :func:`mark_unreachable` makes that processor class use the module-wide
interception from then on.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from contextvars import ContextVar
from types import ModuleType
from typing import Any, Final

import torch

from worldfoundry.core.attention.provider_dispatch import SdpaInterception

logger = logging.getLogger(__name__)

DISPATCH_NAME: Final = "dispatch_attention_fn"
#: Fallback reason of a call whose dispatcher was not reached through the patched module global.
REASON_NOT_REACHED: Final = ("the processor did not reach diffusers' dispatcher through its module "
                             "(PyTorch SDPA ran; its later calls are intercepted module-wide)")


class Pending:
    """The interception of one attention call, waiting for the dispatcher; ``entered`` once it was used."""

    __slots__ = ("entered", "interception")

    def __init__(self, interception: SdpaInterception) -> None:
        self.interception = interception
        self.entered = False


PENDING: ContextVar[Pending | None] = ContextVar("worldfoundry_attention_policy_pending", default=None)

_LOCK = threading.Lock()
#: module name -> [module, original dispatcher, our pass-through, users]
_PATCHED: dict[str, list[Any]] = {}
#: processor classes found to reach the dispatcher another way
_UNREACHABLE: set[type] = set()


def dispatch_namespace(processor: Any) -> ModuleType | None:
    """The module whose ``dispatch_attention_fn`` global ``processor`` calls, or ``None`` (not narrowable)."""
    if type(processor) in _UNREACHABLE:
        return None
    declared = getattr(processor, "dispatch_namespace", None)
    if isinstance(declared, ModuleType):
        return declared if callable(getattr(declared, DISPATCH_NAME, None)) else None
    call = getattr(type(processor), "__call__", None)
    names = getattr(call, "__globals__", None)
    if not isinstance(names, dict) or not callable(names.get(DISPATCH_NAME)):
        return None
    module = sys.modules.get(names.get("__name__", ""))
    return module if module is not None and getattr(module, "__dict__", None) is names else None


def mark_unreachable(processor: Any) -> None:
    """Make ``processor``'s class use the module-wide interception from now on."""
    with _LOCK:
        _UNREACHABLE.add(type(processor))


def is_ours(fn: Any) -> bool:
    """Whether ``fn`` is a pass-through this module installed."""
    return bool(getattr(fn, "__worldfoundry_narrowing__", False))


def _pass_through(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatch_attention_fn(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # a compiled model: nothing of ours is pending there, and dynamo
            return original(*args, **kwargs)  # cannot trace ContextVar.get
        pending = PENDING.get()
        if pending is None:
            return original(*args, **kwargs)
        pending.entered = True
        with pending.interception:
            return original(*args, **kwargs)

    dispatch_attention_fn.__worldfoundry_narrowing__ = True  # type: ignore[attr-defined]
    return dispatch_attention_fn


def acquire(module: ModuleType) -> Callable[[], None]:
    """Put the pass-through in ``module`` (or count one more user of it); returns the release (idempotent)."""
    with _LOCK:
        entry = _PATCHED.get(module.__name__)
        if entry is None:
            original = getattr(module, DISPATCH_NAME)
            wrapper = _pass_through(original)
            setattr(module, DISPATCH_NAME, wrapper)
            _PATCHED[module.__name__] = [module, original, wrapper, 1]
        else:
            entry[3] += 1
    released = [False]

    def release() -> None:
        with _LOCK:
            if released[0]:
                return
            released[0] = True
            entry = _PATCHED[module.__name__]
            entry[3] -= 1
            if entry[3] > 0:
                return
            del _PATCHED[module.__name__]
            if getattr(module, DISPATCH_NAME, None) is entry[2]:
                setattr(module, DISPATCH_NAME, entry[1])
            else:
                logger.warning("%s.%s was replaced after attention_policy installed; left as it is",
                               module.__name__, DISPATCH_NAME)

    return release


def patched_modules() -> dict[str, int]:
    """Modules holding the pass-through now, with their number of users (for tests and reports)."""
    with _LOCK:
        return {name: entry[3] for name, entry in _PATCHED.items()}


__all__ = [
    "DISPATCH_NAME",
    "PENDING",
    "REASON_NOT_REACHED",
    "Pending",
    "acquire",
    "dispatch_namespace",
    "is_ours",
    "mark_unreachable",
    "patched_modules",
]
