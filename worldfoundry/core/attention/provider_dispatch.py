"""Route the SDPA calls of one attention module to attention providers, call by call.

diffusers 0.42 processors compute attention through ``dispatch_attention_fn``; with its ``native`` backend the
dispatcher permutes the ``(B, S, H, D)`` projections to SDPA's ``(B, H, S, D)``, reshapes 2-D masks and calls
:func:`torch.nn.functional.scaled_dot_product_attention`. :class:`SdpaInterception` is a
:class:`torch.overrides.TorchFunctionMode` entered only while one attention module runs (around its dispatcher
call, or around its whole forward): it catches exactly that SDPA call (in the provider contract's layout, with the
dispatcher's mask handling already done) and hands it to the route's provider, or lets it run unchanged. The mode
is thread-local; it can be entered several times for one module call (one interception object counts the module's
SDPA calls in order across its dispatcher calls).

:class:`AttentionRoute` decides per call: below ``min_tokens`` (the shorter of the query and key sequences), inside
the dense first/last steps of the request, or with inputs the provider does not support
(:meth:`~worldfoundry.core.attention.providers.AttentionProvider.check_call`), the call runs PyTorch SDPA and the
reason is reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from worldfoundry.core.acceleration.context import RequestContext
from worldfoundry.core.attention.providers import AttentionProvider
from worldfoundry.errors import AttentionProviderError

#: Attention types a route serves.
SELF: Final = "self"
TEXT_CROSS: Final = "text_cross"
IMAGE_CROSS: Final = "image_cross"
ATTENTION_TYPES: Final = (SELF, TEXT_CROSS, IMAGE_CROSS)

#: Fallback reasons (stable strings: receipts count them).
BELOW_MIN_TOKENS: Final = "below min_tokens"
OUTSIDE_STEP_RANGE: Final = "dense step (outside the step range)"
STEP_UNKNOWN: Final = "step unknown (no request context with step_index/num_steps)"

_SDPA_ARGS: Final = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS: Final[dict[str, Any]] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                                         "enable_gqa": False}


@dataclass(frozen=True)
class AttentionRoute:
    """Where the SDPA calls of one attention type go.

    Attributes:
        attention_type: one of :data:`ATTENTION_TYPES`.
        provider: the provider that runs calls that pass every check.
        min_tokens: calls whose query or key sequence is shorter run PyTorch SDPA.
        dense_first_steps / dense_last_steps: the first / last denoising steps of a request run PyTorch SDPA
            (read from the current :class:`RequestContext`; ``0`` = none).
        unavailable: why the provider cannot run here at all (its probe failed); every call then runs PyTorch
            SDPA with this reason.
    """

    attention_type: str
    provider: AttentionProvider
    min_tokens: int = 0
    dense_first_steps: int = 0
    dense_last_steps: int = 0
    unavailable: str | None = None

    @property
    def uses_steps(self) -> bool:
        return self.dense_first_steps > 0 or self.dense_last_steps > 0

    def decline_before(self, query_tokens: int | None, context: RequestContext | None) -> str | None:
        """Reasons known before the attention runs: availability, query length and step (``None`` = may run the
        provider)."""
        if self.unavailable is not None:
            return self.unavailable
        if query_tokens is not None and query_tokens < self.min_tokens:
            return BELOW_MIN_TOKENS
        if not self.uses_steps:
            return None
        step = context.step_index if context is not None else None
        total = context.num_steps if context is not None else None
        if step is None or (self.dense_last_steps > 0 and total is None):
            return STEP_UNKNOWN
        if step < self.dense_first_steps:
            return OUTSIDE_STEP_RANGE
        if self.dense_last_steps > 0 and step >= total - self.dense_last_steps:
            return OUTSIDE_STEP_RANGE
        return None

    def decline(self, call: dict[str, Any], context: RequestContext | None) -> str | None:
        """Why this SDPA call runs PyTorch SDPA instead of the provider (``None`` = the provider runs it)."""
        query, key = call["query"], call["key"]
        if self.unavailable is not None:
            return self.unavailable
        if min(query.shape[-2], key.shape[-2]) < self.min_tokens:
            return BELOW_MIN_TOKENS
        reason = self.decline_before(None, context)
        if reason is not None:
            return reason
        reason = self.provider.check_call(query, key, call["value"], call["attn_mask"], call["dropout_p"],
                                          call["is_causal"], call["enable_gqa"])
        return None if reason is None else f"{self.provider.name}: {reason}"


def bind_sdpa_call(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of one ``scaled_dot_product_attention`` call by name (defaults filled in)."""
    call = dict(_SDPA_DEFAULTS)
    call.update(zip(_SDPA_ARGS, args))
    call.update(kwargs)
    return call


def run_provider(provider: AttentionProvider, call: dict[str, Any]) -> torch.Tensor:
    """Run ``provider`` on a bound SDPA call and check the result's shape and dtype.

    Raises:
        AttentionProviderError: the provider returned something that is not the SDPA result's shape/dtype.
    """
    query, value = call["query"], call["value"]
    out = provider.attention(query, call["key"], value, attn_mask=call["attn_mask"], dropout_p=call["dropout_p"],
                             is_causal=call["is_causal"], scale=call["scale"])
    expected = (*query.shape[:-1], value.shape[-1])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected or out.dtype != query.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise AttentionProviderError(provider.name, f"returned {got}, expected {expected} {query.dtype}")
    return out


#: ``on_call(route, reason)`` after each intercepted call; ``reason`` is ``None`` when the provider ran it.
CallObserver = Callable[[AttentionRoute, "str | None"], None]


class SdpaInterception(TorchFunctionMode):
    """Send the SDPA calls made inside the block to providers, by call order.

    Args:
        routes: the route of the first, second, ... SDPA call of the block (the last one serves any further
            calls); ``None`` lets that call run unchanged and unreported.
        context: the request context (for the step range).
        on_call: called with ``(route, reason)`` for every call that has a route.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from worldfoundry.core.attention.builtin_providers import builtin_providers
        >>> math = {p.name: p for p in builtin_providers()}["sdpa_math"]
        >>> seen = []
        >>> q = torch.randn(1, 2, 8, 16)
        >>> with SdpaInterception([AttentionRoute("self", math)], None, lambda r, why: seen.append(why)):
        ...     out = F.scaled_dot_product_attention(q, q, q)
        >>> seen
        [None]
    """

    def __init__(self, routes: Sequence[AttentionRoute | None], context: RequestContext | None,
                 on_call: CallObserver) -> None:
        super().__init__()
        self._routes = tuple(routes)
        self._context = context
        self._on_call = on_call
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        index = self.calls
        self.calls += 1
        route = self._routes[min(index, len(self._routes) - 1)] if self._routes else None
        if route is None:
            return func(*args, **kwargs)
        call = bind_sdpa_call(args, kwargs)
        reason = route.decline(call, self._context)
        if reason is not None:
            self._on_call(route, reason)
            return func(*args, **kwargs)
        out = run_provider(route.provider, call)
        self._on_call(route, None)
        return out


__all__ = [
    "ATTENTION_TYPES",
    "BELOW_MIN_TOKENS",
    "IMAGE_CROSS",
    "OUTSIDE_STEP_RANGE",
    "SELF",
    "STEP_UNKNOWN",
    "TEXT_CROSS",
    "AttentionRoute",
    "CallObserver",
    "SdpaInterception",
    "bind_sdpa_call",
    "run_provider",
]
