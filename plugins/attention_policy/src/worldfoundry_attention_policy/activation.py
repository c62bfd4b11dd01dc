"""``activate`` of ``attention_policy`` and its handle.

Each planned attention module's ``forward`` is wrapped (recorded, so uninstall restores it exactly). Per call the
wrapper checks that the processor still dispatches to diffusers' ``native`` backend, settles what it can before
attention runs (probe failure, query below ``min_tokens``, dense step) without any interception, and otherwise
runs the original forward inside :class:`~worldfoundry.core.attention.provider_dispatch.SdpaInterception`, which
hands each SDPA call to its route's provider or lets it run. Every routed call is counted: ``executed(module,
provider)`` or ``fallback(module, "<type>: <reason>")``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from worldfoundry.base_models.diffusion_model.optimizations.attention_sites import (
    NATIVE_DIFFUSERS_BACKEND,
    diffusers_attention_backend,
)
from worldfoundry.core.acceleration.context import current_request
from worldfoundry.core.acceleration.handle import RecordedHandle
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.receipts import ExecutionLedger
from worldfoundry.core.attention.provider_dispatch import AttentionRoute, SdpaInterception
from worldfoundry_attention_policy.options import PLUGIN_NAME
from worldfoundry_attention_policy.plan import SitePlan

logger = logging.getLogger(__name__)


class AttentionPolicyHandle(RecordedHandle):
    """Undoes the wrapped forwards; reports calls per provider and fallbacks per module."""

    def __init__(self, patches: PatchRecorder, ledger: ExecutionLedger, plans: list[SitePlan],
                 routes: dict[str, AttentionRoute]) -> None:
        super().__init__(PLUGIN_NAME, patches, ledger)
        self._plans = plans
        self._routes = routes

    def end_request(self, request_id: str) -> None:
        self.ledger.finish(request_id)

    def execution_report(self) -> dict[str, Any]:
        report = super().execution_report()
        report["routes"] = {kind: {"provider": r.provider.name, "version": r.provider.version,
                                   "numerics": r.provider.numerics, "min_tokens": r.min_tokens,
                                   "dense_first_steps": r.dense_first_steps, "dense_last_steps": r.dense_last_steps,
                                   "unavailable": r.unavailable}
                            for kind, r in sorted(self._routes.items())}
        report["modules_routed"] = len(self._plans)
        return report


def activate(plans: list[SitePlan], routes: dict[str, AttentionRoute]) -> AttentionPolicyHandle:
    """Wrap the forward of every planned attention module; a failure part-way undoes everything."""
    ledger = ExecutionLedger(PLUGIN_NAME)
    with PatchRecorder(PLUGIN_NAME) as recorder:
        for plan in plans:
            recorder.wrap_forward(plan.site.module, _routing_forward(plan, ledger), name=PLUGIN_NAME)
        patches = recorder.pop_all()
    logger.debug("%s active on %d attention module(s)", PLUGIN_NAME, len(plans))
    return AttentionPolicyHandle(patches, ledger, plans, routes)


def _query_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    return int(hidden.shape[1]) if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else None


def _routing_forward(plan: SitePlan, ledger: ExecutionLedger) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    path = plan.path
    module = plan.site.module
    routes = plan.routes
    active = [r for r in routes if r is not None]

    def on_call(route: AttentionRoute, reason: str | None) -> None:
        if reason is None:
            ledger.executed(path, route.provider.name)
        else:
            ledger.fallback(path, f"{route.attention_type}: {reason}")

    def make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            backend = diffusers_attention_backend(module.processor)
            if backend != NATIVE_DIFFUSERS_BACKEND:
                for route in active:
                    on_call(route, f"diffusers attention backend {backend!r} is active, not "
                                   f"{NATIVE_DIFFUSERS_BACKEND!r}")
                return original(*args, **kwargs)
            context = current_request()
            tokens = _query_tokens(args, kwargs)
            early = [route.decline_before(tokens, context) for route in active]
            if all(reason is not None for reason in early):
                for route, reason in zip(active, early, strict=True):
                    on_call(route, reason)
                return original(*args, **kwargs)
            with SdpaInterception(routes, context, on_call):
                return original(*args, **kwargs)

        return forward

    return make_wrapper


__all__ = ["AttentionPolicyHandle", "activate"]
