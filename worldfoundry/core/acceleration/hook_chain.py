"""Hook chains other libraries build on top of a patched ``forward``, and how to take a patch out of them.

diffusers' ``HookRegistry`` (``enable_cache``, group offloading, layerwise casting) and accelerate's
``add_hook_to_module`` (``enable_model_cpu_offload``) replace ``module.forward`` with their own function and keep
the forward they found (ours, if a plugin patched it first) as a reference: diffusers in a
``HookFunctionReference`` (``forward`` or ``original_forward``), accelerate in ``module._old_forward``. Uninstall
then need not remove their hooks: :func:`find_link` finds where our function sits in the chain and
:func:`splice` puts the forward we replaced in its place, so the user's hooks keep running, on the original.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch.nn as nn

#: Attributes of diffusers' ``HookFunctionReference`` that may hold the forward a hook wraps.
_DIFFUSERS_LINKS = ("original_forward", "forward")


def find_link(module: Any, ours: Any) -> Callable[[Any], None] | None:
    """Where ``ours`` (a forward we set on ``module``) sits inside another library's hook chain.

    Args:
        module: the module whose ``forward`` was patched.
        ours: the function the patch set.

    Returns:
        A setter replacing ``ours`` in the chain, or ``None`` when no known chain holds it.
    """
    if not isinstance(module, nn.Module):
        return None
    registry = module.__dict__.get("_diffusers_hook")
    for fn_ref in getattr(registry, "_fn_refs", ()) or ():
        for attr in _DIFFUSERS_LINKS:
            if getattr(fn_ref, attr, None) is ours:
                return lambda value, ref=fn_ref, a=attr: setattr(ref, a, value)
    if module.__dict__.get("_old_forward") is ours:  # accelerate's hook
        return lambda value: module.__dict__.__setitem__("_old_forward", value)
    return None


def splice(module: nn.Module, ours: Any, previous: Any, absent: Any) -> bool:
    """Replace ``ours`` inside another library's chain by ``previous`` (the class's forward when ``absent``).

    Returns:
        ``True`` when spliced, ``False`` when ``ours`` is in no known chain.
    """
    link = find_link(module, ours)
    if link is None:
        return False
    link(types.MethodType(type(module).forward, module) if previous is absent else previous)
    return True


__all__ = ["find_link", "splice"]
