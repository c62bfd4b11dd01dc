"""``activate`` of ``attention_policy`` and its handle.

Each planned attention module's ``forward`` is wrapped (recorded, so uninstall restores it exactly). Per call the
wrapper checks that the processor still dispatches to diffusers' ``native`` backend, settles what it can before
attention runs (probe failure, query below ``min_tokens``, dense step) without any interception, and otherwise
runs the original forward with an :class:`~worldfoundry.core.attention.provider_dispatch.SdpaInterception`, which
hands each SDPA call to its route's provider or lets it run: entered around diffusers' dispatcher call only where
the processor's module allows it (:mod:`~worldfoundry_attention_policy.narrowing`), else around the whole forward.
Every routed call is counted: ``executed(module, provider)`` or ``fallback(module, "<type>: <reason>")``; the
report's ``interception`` says how many calls took each of the two paths.

Beside ``cuda_graph`` (:meth:`AttentionPolicyHandle.graph_call`): which provider runs a call is settled by the
shapes (part of every graph's signature), the modules' diffusers attention backends and, for a route with a step
range, the request's step; the last two are the graph key, so each combination is captured once and replays run
the providers the eager path would have chosen. The ledger calls made while a forward is captured are applied
again on every replay by the graph runner; the interception-path counters are taken back and re-counted the same
way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from worldfoundry.base_models.diffusion_model.optimizations.attention_sites import (
    NATIVE_DIFFUSERS_BACKEND,
    diffusers_attention_backend,
)
from worldfoundry.core.acceleration.context import current_request
from worldfoundry.core.acceleration.cuda_graph.participants import GraphCall
from worldfoundry.core.acceleration.handle import RecordedHandle
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.receipts import ExecutionLedger
from worldfoundry.core.attention.provider_dispatch import AttentionRoute, SdpaInterception
from worldfoundry_attention_policy import narrowing
from worldfoundry_attention_policy.options import PLUGIN_NAME
from worldfoundry_attention_policy.plan import SitePlan

logger = logging.getLogger(__name__)


class AttentionPolicyHandle(RecordedHandle):
    """Undoes the wrapped forwards; reports calls per provider and fallbacks per module."""

    def __init__(self, patches: PatchRecorder, ledger: ExecutionLedger, plans: list[SitePlan],
                 routes: dict[str, AttentionRoute], paths: dict[str, int] | None = None) -> None:
        super().__init__(PLUGIN_NAME, patches, ledger)
        self._plans = plans
        self._routes = routes
        self._paths = paths if paths is not None else {"dispatcher_only": 0, "module_wide": 0}

    def end_request(self, request_id: str) -> None:
        self.ledger.finish(request_id)

    # ------------------------------------------------------------------ CUDA-graph capture
    def graph_call(self) -> GraphCall:
        """The state beyond shapes that selects the providers of this model call (see the module docstring)."""
        context = current_request()
        steps = tuple(route.decline_before(None, context) for _, route in sorted(self._routes.items())
                      if route.uses_steps)
        backends = tuple(diffusers_attention_backend(plan.site.module.processor) for plan in self._plans)
        return GraphCall(key=("attention_policy", steps, backends), serve=self._serve_capture,
                         replayed=self._count_replay)

    @contextlib.contextmanager
    def _serve_capture(self, buffers: Sequence[Any]) -> Iterator[dict[str, int]]:
        before = dict(self._paths)
        taken: dict[str, int] = {}
        try:
            yield taken
        finally:
            for key, n in self._paths.items():
                taken[key] = n - before.get(key, 0)
                self._paths[key] = before.get(key, 0)

    def _count_replay(self, taken: dict[str, int]) -> None:
        for key, n in taken.items():
            self._paths[key] = self._paths.get(key, 0) + n

    def execution_report(self) -> dict[str, Any]:
        report = super().execution_report()
        report["routes"] = {kind: {"provider": r.provider.name, "version": r.provider.version,
                                   "numerics": r.provider.numerics, "min_tokens": r.min_tokens,
                                   "dense_first_steps": r.dense_first_steps, "dense_last_steps": r.dense_last_steps,
                                   "unavailable": r.unavailable}
                            for kind, r in sorted(self._routes.items())}
        report["interception"] = dict(self._paths)
        report["modules_routed"] = len(self._plans)
        return report


def activate(plans: list[SitePlan], routes: dict[str, AttentionRoute]) -> AttentionPolicyHandle:
    """Wrap the forward of every planned attention module; a failure part-way undoes everything."""
    ledger = ExecutionLedger(PLUGIN_NAME)
    paths = {"dispatcher_only": 0, "module_wide": 0}
    with PatchRecorder(PLUGIN_NAME) as recorder:
        acquired: set[str] = set()
        for plan in plans:
            namespace = narrowing.dispatch_namespace(plan.site.module.processor)
            if namespace is not None and namespace.__name__ not in acquired:
                recorder.callback(narrowing.acquire(namespace),
                                  f"{PLUGIN_NAME}: pass-through {namespace.__name__}.{narrowing.DISPATCH_NAME}")
                acquired.add(namespace.__name__)
        for plan in plans:
            recorder.wrap_forward(plan.site.module, _routing_forward(plan, ledger, frozenset(acquired), paths),
                                  name=PLUGIN_NAME)
        patches = recorder.pop_all()
    logger.debug("%s active on %d attention module(s)", PLUGIN_NAME, len(plans))
    return AttentionPolicyHandle(patches, ledger, plans, routes, paths)


def _query_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    return int(hidden.shape[1]) if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else None


def _routing_forward(plan: SitePlan, ledger: ExecutionLedger, acquired: frozenset[str],
                     paths: dict[str, int]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
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
            interception = SdpaInterception(routes, context, on_call)
            namespace = narrowing.dispatch_namespace(module.processor)
            if namespace is None or namespace.__name__ not in acquired:
                paths["module_wide"] += 1
                with interception:
                    return original(*args, **kwargs)
            return _dispatcher_only(interception, original, args, kwargs)

        def _dispatcher_only(interception: SdpaInterception, original: Callable[..., Any], args: Any,
                             kwargs: Any) -> Any:
            pending = narrowing.Pending(interception)
            token = narrowing.PENDING.set(pending)
            try:
                out = original(*args, **kwargs)
            finally:
                narrowing.PENDING.reset(token)
            if pending.entered:
                paths["dispatcher_only"] += 1
            else:  # SDPA ran unrouted: say so, and route this processor class module-wide from now on
                narrowing.mark_unreachable(module.processor)
                for route in active:
                    on_call(route, narrowing.REASON_NOT_REACHED)
            return out

        return forward

    return make_wrapper


__all__ = ["AttentionPolicyHandle", "activate"]
