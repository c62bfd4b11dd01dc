"""Glue: registration and ``prepare`` (validation only) of ``attention_policy``; activation is in
:mod:`worldfoundry_attention_policy.activation`.

For each attention type named in the options (``self``, ``text_cross``, ``image_cross``) the SDPA calls of the
model's attention modules of that type run on the chosen attention provider (from the
:class:`~worldfoundry.core.attention.provider_registry.AttentionProviderRegistry`: the PyTorch SDPA backends,
and whatever distributions registered through ``worldfoundry.attention_providers``), call by call, with
``min_tokens`` and dense first/last steps falling back to PyTorch SDPA visibly.

Claims: the path of every attention module whose calls it reroutes, so ``optimized_mha`` with an explicit
``sdpa_backend`` on the same modules conflicts by name before anything changes; ``role:approximate_attention``
when any routed provider is ``approximate``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

import worldfoundry
from worldfoundry.base_models.diffusion_model.optimizations.families import family_of
from worldfoundry.base_models.diffusion_model.optimizations.refusals import refuse_common
from worldfoundry.core.acceleration.prepared import ROLE_APPROXIMATE_ATTENTION, PreparedAcceleration
from worldfoundry.core.attention.provider_dispatch import AttentionRoute
from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry, attention_provider_registry
from worldfoundry.core.attention.providers import APPROXIMATE
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry_attention_policy.activation import AttentionPolicyHandle, activate
from worldfoundry_attention_policy.options import PLUGIN_NAME, Options
from worldfoundry_attention_policy.plan import (
    SitePlan,
    build_routes,
    call_types,
    plan_sites,
    probe_routes,
    resolve_providers,
)

PrepareFn = Callable[[nn.Module, Mapping[str, Any], RuntimePolicy], PreparedAcceleration]


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Called once by the registry when it discovers this distribution's entry point."""
    register(PLUGIN_NAME, prepare, options=Options)


def make_prepare(providers: AttentionProviderRegistry | None = None) -> PrepareFn:
    """A prepare factory that looks providers up in ``providers`` (default: the process-wide registry).

    Example:
        >>> from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry
        >>> factory = make_prepare(AttentionProviderRegistry(discover=False))
        >>> callable(factory)
        True
    """

    def prepare_with(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
        registry = providers if providers is not None else attention_provider_registry()
        return _prepare(model, options, registry)

    prepare_with.options_class = Options  # type: ignore[attr-defined]
    return prepare_with


def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
    """Validate ``options`` against ``model`` and the process-wide provider registry; change nothing.

    Raises:
        AccelerationOptionsError: bad options, nothing selected, or a backend naming no registered provider.
        AccelerationRefusedError: unsupported / compiled / CUDA-graph / training model, a type the model lacks,
            linear attention, an unknown processor or a non-native diffusers attention backend, or a provider
            whose probe fails with ``on_unavailable="error"``.
    """
    return _prepare(model, options, attention_provider_registry())


def _prepare(model: nn.Module, options: Mapping[str, Any], registry: AttentionProviderRegistry) -> PreparedAcceleration:
    opts = Options.from_mapping(options)
    family = family_of(model, plugin=PLUGIN_NAME)
    refuse_common(model, PLUGIN_NAME)
    providers = resolve_providers(opts, registry)
    first = plan_sites(opts, family, model, build_routes(opts, providers))
    unavailable = probe_routes(opts, providers, first)
    routes = build_routes(opts, providers, unavailable)
    plans = [SitePlan(p.site, tuple(routes.get(t) for t in call_types(p.site))) for p in first]
    usable = {kind: r for kind, r in routes.items() if r.unavailable is None}
    claims = {plan.path for plan in plans}
    if any(r.provider.numerics == APPROXIMATE for r in usable.values()):
        claims.add(ROLE_APPROXIMATE_ATTENTION)
    return PreparedAcceleration(
        name=PLUGIN_NAME,
        claims=frozenset(claims),
        activate=lambda: activate(plans, routes),
        options=opts.to_json(),
        exact=not usable,
        notes=tuple(_notes(routes, plans)),
    )


def _notes(routes: dict[str, AttentionRoute], plans: list[SitePlan]) -> list[str]:
    notes = []
    for kind, route in sorted(routes.items()):
        provider = route.provider
        count = sum(1 for p in plans if route in p.routes)
        if count == 0:
            notes.append(f"{kind}: this model has no {kind} attention (skipped)")
            continue
        what = ("same accuracy class as PyTorch SDPA, new rounding (not bitwise)"
                if provider.numerics != APPROXIMATE else "approximate: judged on quality")
        line = (f"{kind}: {provider.name} {provider.version} on {count} attention module(s), {what}; "
                f"min_tokens {route.min_tokens}")
        if route.uses_steps:
            line += f"; dense first {route.dense_first_steps} / last {route.dense_last_steps} steps"
        notes.append(line)
        if route.unavailable is not None:
            notes.append(f"{kind}: falls back to PyTorch SDPA on every call ({route.unavailable})")
    notes.append("calls below min_tokens, in dense steps or with inputs a provider does not support run PyTorch "
                 "SDPA and are counted as fallbacks with the reason")
    return notes


prepare.options_class = Options  # type: ignore[attr-defined]  # tools validate options without a model

__all__ = ["AttentionPolicyHandle", "make_prepare", "prepare"]
