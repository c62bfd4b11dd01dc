"""Host-side shortcuts of the fused Wan block: the same operations with less Python around them.

A W17 forward of Wan2.1-1.3B is bound by the host (launches, module calls, the attention dispatcher), so the
fused forward also avoids Python work that computes nothing. Each shortcut applies only where it provably runs the
operations eager runs, and otherwise the module or function is called as usual:

* :func:`skips_dropout` -- an ``nn.Dropout`` that returns its input (evaluation mode or ``p == 0``: PyTorch's
  ``dropout`` returns the very input tensor then) and has no wrapper or hook of its own is not called.
* :func:`feed_forward` -- diffusers' ``FeedForward`` (class forward, no wrapper or hook) runs its ``net`` directly,
  so identity dropouts in it are skipped; any other feed-forward module is called.
* :func:`native_sdpa` -- ``dispatch_attention_fn`` with no backend given, PyTorch's native backend active and
  registered as diffusers ships it, no context parallelism, no mask and diffusers' argument checks off calls
  ``F.scaled_dot_product_attention`` on the ``[B, H, S, D]`` permutations exactly as diffusers' native backend does.
  When the dispatcher is wrapped or patched (e.g. by ``attention_policy``), the wrapper runs instead.

Example:
    >>> import torch.nn as nn
    >>> skips_dropout(nn.Dropout(0.1).eval(), global_hooks=False)
    True
    >>> skips_dropout(nn.Dropout(0.1).train(), global_hooks=False)
    False
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812


def skips_dropout(module: nn.Module, *, global_hooks: bool) -> bool:
    """Whether calling ``module`` would return its input unchanged and run nothing else."""
    return (type(module) is nn.Dropout and (not module.training or module.p == 0.0) and not global_hooks
            and not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__))


@functools.cache
def _feed_forward_type() -> type | None:
    try:
        from diffusers.models.attention import FeedForward
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return None
    return FeedForward


def feed_forward(ffn: nn.Module, hidden_states: torch.Tensor, *, global_hooks: bool) -> torch.Tensor:
    """``ffn(hidden_states)``, running diffusers' ``FeedForward.net`` directly where that is what the call does."""
    if (type(ffn) is not _feed_forward_type() or global_hooks or "forward" in ffn.__dict__
            or ffn._forward_hooks or ffn._forward_pre_hooks):
        return ffn(hidden_states)
    for module in ffn.net._modules.values():
        if not skips_dropout(module, global_hooks=False):
            hidden_states = module(hidden_states)
    return hidden_states


@functools.cache
def _native_dispatch() -> tuple[Any, Any, Any, Any] | None:
    """(diffusers' dispatch function, its registry, the native backend's name and function), or ``None``."""
    try:
        from diffusers.models import attention_dispatch as ad
    except ImportError:  # pragma: no cover
        return None
    registry = getattr(ad, "_AttentionBackendRegistry", None)
    name = getattr(getattr(ad, "AttentionBackendName", None), "NATIVE", None)
    fn = getattr(ad, "_native_attention", None)
    if registry is None or name is None or fn is None:
        return None
    return ad.dispatch_attention_fn, registry, name, fn


def native_sdpa(dispatch: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: Any,
                parallel_config: Any) -> torch.Tensor | None:
    """Attention as ``dispatch(query, key, value)`` computes it, when that is PyTorch's SDPA called directly
    (module docs); ``None`` where the dispatcher must run."""
    native = _native_dispatch()
    if native is None or dispatch is not native[0] or backend is not None or parallel_config is not None:
        return None
    _, registry, name, fn = native
    if (registry._active_backend != name or registry._checks_enabled
            or registry._backends.get(name) is not fn):
        return None
    out = F.scaled_dot_product_attention(query.permute(0, 2, 1, 3), key.permute(0, 2, 1, 3),
                                         value.permute(0, 2, 1, 3), attn_mask=None, dropout_p=0.0,
                                         is_causal=False, scale=None)
    return out.permute(0, 2, 1, 3)


__all__ = ["feed_forward", "native_sdpa", "skips_dropout"]
