"""What ``attention_policy`` will do, decided at prepare time from the options, the model and the provider
registry (nothing is changed here).

Attention types per module: a self-attention module makes one ``self`` SDPA call; a cross-attention module makes
one ``text_cross`` call, preceded (Wan I2V, ``add_k_proj`` present) by one ``image_cross`` call — the order of
``WanAttnProcessor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from worldfoundry.base_models.diffusion_model.optimizations.attention_sites import (
    check_known_processor,
    head_dim,
    sdpa_capable,
)
from worldfoundry.base_models.diffusion_model.optimizations.families import AttentionSite, ModelFamily
from worldfoundry.core.attention.provider_dispatch import IMAGE_CROSS, SELF, TEXT_CROSS, AttentionRoute
from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry
from worldfoundry.core.attention.providers import AttentionProvider
from worldfoundry.errors import AccelerationOptionsError, AccelerationRefusedError, UnknownAttentionProviderError
from worldfoundry_attention_policy.options import PLUGIN_NAME, Options, TypePolicy


@dataclass(frozen=True)
class SitePlan:
    """One attention module and the route of each SDPA call it makes (``None`` = left unchanged)."""

    site: AttentionSite
    routes: tuple[AttentionRoute | None, ...]

    @property
    def path(self) -> str:
        return self.site.path

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.site.kind,
                "calls": [None if r is None else {"type": r.attention_type, "provider": r.provider.name}
                          for r in self.routes]}


def call_types(site: AttentionSite) -> tuple[str, ...]:
    """The attention type of each SDPA call of ``site``, in call order."""
    if site.kind == "self":
        return (SELF,)
    return (IMAGE_CROSS, TEXT_CROSS) if site.image_kv else (TEXT_CROSS,)


def resolve_providers(opts: Options, registry: AttentionProviderRegistry) -> dict[str, AttentionProvider]:
    """Attention type -> provider for every routed type.

    Raises:
        AccelerationOptionsError: a backend names no registered provider (``.path`` is ``<type>.backend``).
    """
    providers = {}
    for kind, policy in opts.routed().items():
        try:
            providers[kind] = registry.get(policy.backend)
        except UnknownAttentionProviderError as exc:
            raise AccelerationOptionsError(PLUGIN_NAME, f"{kind}.backend: {exc}", path=f"{kind}.backend") from exc
    return providers


def _site_types(sites: list[AttentionSite]) -> set[str]:
    return {t for s in sites for t in call_types(s)}


def check_types_present(opts: Options, sites: list[AttentionSite], model: nn.Module) -> None:
    """Refuse a routed type the model does not have (``cross`` skips a missing one of its two types).

    Raises:
        AccelerationRefusedError: naming the type and the model class.
    """
    present = _site_types(sites)
    routed = set(opts.routed())
    missing = sorted(routed - present)
    if opts.cross_shorthand:
        cross = {TEXT_CROSS, IMAGE_CROSS} & routed
        if cross and not cross & present:
            missing = sorted(set(missing) | {"cross"})
        missing = [m for m in missing if m not in (TEXT_CROSS, IMAGE_CROSS)]
    if missing:
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"{type(model).__name__} has no softmax {', '.join(missing)} attention; remove "
            f"{missing} from the options")


def plan_sites(opts: Options, family: ModelFamily, model: nn.Module,
               routes: dict[str, AttentionRoute]) -> list[SitePlan]:
    """One :class:`SitePlan` per attention module that has at least one routed call.

    Raises:
        AccelerationRefusedError: unknown processor, linear attention asked for, or a processor that does not
            dispatch to diffusers' ``native`` backend (PyTorch SDPA).
    """
    sites = [s for s in family.attention_sites(model) if s.softmax]
    linear = [s for s in family.attention_sites(model) if not s.softmax and s.kind == "self"]
    if linear and SELF in opts.routed():
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"{linear[0].path} is linear attention ({family.name}) and calls no scaled-dot-product "
            "attention; remove 'self' from the options")
    check_types_present(opts, sites, model)
    plans = []
    for site in sites:
        site_routes = tuple(routes.get(t) for t in call_types(site))
        if all(r is None for r in site_routes):
            continue
        processor = check_known_processor(site, family, PLUGIN_NAME)
        reason = sdpa_capable(site, processor)
        if reason is not None:
            raise AccelerationRefusedError(PLUGIN_NAME, reason)
        plans.append(SitePlan(site, site_routes))
    return plans


def probe_routes(opts: Options, providers: dict[str, AttentionProvider], plans: list[SitePlan]) -> dict[str, str]:
    """Probe every routed provider where it will run; attention type -> reason for those that cannot.

    Raises:
        AccelerationRefusedError: a probe failed and ``on_unavailable`` is ``"error"``.
    """
    failures: dict[str, str] = {}
    done: dict[tuple[Any, ...], str | None] = {}
    for plan in plans:
        weight = plan.site.module.to_q.weight
        size = head_dim(plan.site)
        for route in plan.routes:
            if route is None or route.attention_type in failures:
                continue
            provider = providers[route.attention_type]
            key = (provider.name, weight.device, weight.dtype, size)
            if key not in done:
                done[key] = provider.probe(weight.device, weight.dtype, size)
            if done[key] is not None:
                failures[route.attention_type] = done[key]
    if failures and opts.on_unavailable == "error":
        kind, reason = next(iter(sorted(failures.items())))
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"{kind}.backend={providers[kind].name!r} cannot run here: {reason}. Choose another "
            "backend, or set on_unavailable='fallback' to install anyway and run PyTorch SDPA (counted in the "
            "receipts)")
    return failures


def build_routes(opts: Options, providers: dict[str, AttentionProvider],
                 unavailable: dict[str, str] | None = None) -> dict[str, AttentionRoute]:
    """Attention type -> :class:`AttentionRoute` for every routed type."""
    unavailable = unavailable or {}
    routes = {}
    for kind, policy in opts.routed().items():
        routes[kind] = _route(kind, policy, providers[kind], unavailable.get(kind))
    return routes


def _route(kind: str, policy: TypePolicy, provider: AttentionProvider, unavailable: str | None) -> AttentionRoute:
    return AttentionRoute(kind, provider, policy.min_tokens, policy.dense_first_steps, policy.dense_last_steps,
                          unavailable=None if unavailable is None else f"{provider.name} unavailable: {unavailable}")


__all__ = ["SitePlan", "build_routes", "call_types", "plan_sites", "probe_routes", "resolve_providers"]
