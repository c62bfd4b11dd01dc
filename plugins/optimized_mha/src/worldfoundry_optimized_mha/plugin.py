"""Glue: registration and ``prepare`` (validation only) of ``optimized_mha``; activation is in
:mod:`worldfoundry_optimized_mha.activation`.

Per attention module selected by the options:

* fusion (``"qkv"`` / ``"kv"``): the projections that read one input are packed into one storage and the original
  Parameters become views of it (:class:`~worldfoundry.core.attention.packed_storage.PackedLinearParameters`).
  Where the diffusers processor has a fused-projection branch (Wan, MiniMax-H3) the plugin turns it on and serves
  ``to_qkv`` / ``to_kv`` / ``to_added_kv`` from the packed storage with a plain callable
  (:class:`~worldfoundry.core.attention.packed_projection.PackedProjection`); elsewhere (SANA-Video) the
  projections' forwards are wrapped (:class:`~worldfoundry.core.attention.fused_projection.SharedInputProjection`).
  Both are bitwise-verified per input geometry (:mod:`worldfoundry_optimized_mha.plan`);
* an explicit ``sdpa_backend``: the attention module's forward runs inside
  :func:`~worldfoundry.core.attention.sdpa_backends.sdpa_backend_scope`, so every SDPA call uses that backend or
  raises :class:`~worldfoundry.errors.AttentionBackendError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

import worldfoundry
from worldfoundry.base_models.diffusion_model.optimizations.attention_sites import (
    check_attention_site,
    head_dim,
    projection_groups,
    sdpa_capable,
)
from worldfoundry.core.attention.packed_storage import (
    check_linears_packable,
    storage_owners,
)
from worldfoundry.core.attention.sdpa_backends import probe_sdpa_backend
from worldfoundry.plugin import (
    ROLE_APPROXIMATE_ATTENTION,
    ROLE_OFFLOAD,
    AccelerationRefusedError,
    AttentionBackendError,
    AttentionSite,
    ModelFamily,
    ParameterPackingError,
    PreparedAcceleration,
    RuntimePolicy,
    family_of,
    refuse_common,
    refuse_module_hooks,
)
from worldfoundry_optimized_mha.activation import OptimizedMHAHandle, activate
from worldfoundry_optimized_mha.options import PLUGIN_NAME, AttentionOptions, Options
from worldfoundry_optimized_mha.plan import (
    FUSED_BRANCH,
    PROJECTION_WRAPPERS,
    SitePlan,
    choose_projection_path,
    path_summary,
    refuse_diffusers_fused,
)

logger = logging.getLogger(__name__)


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Called once by the registry when it discovers this distribution's entry point."""
    register(PLUGIN_NAME, prepare, options=Options)


# ---------------------------------------------------------------------------------------------- prepare
def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
    """Validate ``options`` against ``model``; change nothing.

    Raises:
        AccelerationOptionsError: unknown/invalid options or nothing selected.
        AccelerationRefusedError: unsupported model, compiled / CUDA-graph / sequence-parallel / hooked / training
            model, unknown attention processor, projections that cannot share one storage (tied, quantized,
            non-float, mixed dtype/device), a backend that is unavailable or not applicable.
    """
    opts = Options.from_mapping(options)
    family = family_of(model, plugin=PLUGIN_NAME)
    refuse_common(model, PLUGIN_NAME)
    owners = storage_owners(model)
    probed: set[tuple[Any, ...]] = set()
    plans: list[SitePlan] = []
    for settings in opts.kinds():
        sites = family.attention_sites(model, kinds=(settings.kind,))
        if not sites:
            if opts.defaults:
                continue
            raise AccelerationRefusedError(
                PLUGIN_NAME,
                f"{type(model).__name__} has no {settings.kind}-attention; remove {settings.kind!r} from the options",
            )
        for site in sites:
            plans.append(_plan_site(site, family, settings, owners, probed))
    claims: set[str] = set()
    for plan in plans:
        for group in plan.groups:
            claims.update(group.paths())
        if plan.settings.explicit_backend:
            claims.add(plan.site.path)
    notes = [("fused projections are checked bitwise against the separate projections on the first call of every "
              "input shape; shapes that differ run the separate projections (reason fused_gemm_not_bitwise)"),
             "packed Parameters view one storage: no weight memory is added; uninstall gives them separate storages"]
    paths = path_summary(plans)
    if paths:
        notes.append("projection paths: " + ", ".join(f"{name} on {n} attention module(s)"
                                                        for name, n in sorted(paths.items())))
    reasons = sorted({p.path_reason for p in plans if p.projection_path == PROJECTION_WRAPPERS and p.path_reason})
    notes.extend(f"{PROJECTION_WRAPPERS}: {reason}" for reason in reasons)
    for settings in opts.kinds():
        if settings.explicit_backend:
            notes.append(f"sdpa backend {settings.sdpa_backend!r} on {settings.kind}-attention changes rounding")
    if not opts.exact:
        claims.add(ROLE_APPROXIMATE_ATTENTION)
    return PreparedAcceleration(
        name=PLUGIN_NAME,
        claims=frozenset(claims),
        activate=lambda: activate(model, plans),
        incompatible_with=frozenset({ROLE_OFFLOAD}),
        options=opts.to_json(),
        exact=opts.exact,
        notes=tuple(notes),
    )


def _plan_site(site: AttentionSite, family: ModelFamily, settings: AttentionOptions,
               owners: dict[int, list[str]], probed: set[tuple[Any, ...]]) -> SitePlan:
    processor = check_attention_site(site, family, PLUGIN_NAME)
    plan = SitePlan(site, settings)
    if settings.fuses:
        refuse_diffusers_fused(site)
        for group in projection_groups(site):
            named = group.named_modules()
            refuse_module_hooks(named, PLUGIN_NAME)
            try:
                check_linears_packable(named, owners=owners, share_storage=True)
            except ParameterPackingError as exc:
                raise AccelerationRefusedError(
                    PLUGIN_NAME, f"cannot pack {group.name} of {site.path} into one storage: {exc}"
                ) from exc
            plan.groups.append(group)
        choose_projection_path(plan, family)
    if settings.explicit_backend:
        reason = sdpa_capable(site, processor)
        if reason is not None:
            raise AccelerationRefusedError(PLUGIN_NAME, f"sdpa_backend={settings.sdpa_backend!r}: {reason}")
        weight = site.module.to_q.weight
        key = (settings.sdpa_backend, weight.device, weight.dtype, head_dim(site))
        if key not in probed:
            try:
                probe_sdpa_backend(settings.sdpa_backend, device=weight.device, dtype=weight.dtype, head_dim=key[3])
            except AttentionBackendError as exc:
                raise AccelerationRefusedError(
                    PLUGIN_NAME,
                    f"sdpa_backend={settings.sdpa_backend!r} is not available for {weight.dtype} on {weight.device} "
                    f"with head size {key[3]}: {exc.reason}",
                ) from exc
            probed.add(key)
    return plan


__all__ = ["FUSED_BRANCH", "PROJECTION_WRAPPERS", "OptimizedMHAHandle", "SitePlan", "activate", "prepare"]
