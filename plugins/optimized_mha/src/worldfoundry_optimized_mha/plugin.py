"""Glue: registration, ``prepare`` (validation only) and ``activate`` of ``optimized_mha``.

Per attention module selected by the options:

* fusion (``"qkv"`` / ``"kv"``): the projections that read one input are packed into one storage and the original
  Parameters become views of it (:class:`~worldfoundry.core.attention.packed_storage.PackedLinearParameters`);
  the first projection's forward runs one GEMM on the packed weight and the others take their slice
  (:class:`~worldfoundry.core.attention.fused_projection.SharedInputProjection`, bitwise-verified per shape);
* an explicit ``sdpa_backend``: the attention module's forward runs inside
  :func:`~worldfoundry.core.attention.sdpa_backends.sdpa_backend_scope`, so every SDPA call uses that backend or
  raises :class:`~worldfoundry.errors.AttentionBackendError`.

Everything is recorded with a :class:`PatchRecorder`; uninstall unwraps the forwards and gives every packed
Parameter a separate storage again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

import worldfoundry
from worldfoundry.base_models.diffusion_model.optimizations.attention_sites import (
    NATIVE_DIFFUSERS_BACKEND,
    ProjectionGroup,
    check_attention_site,
    diffusers_attention_backend,
    head_dim,
    projection_groups,
    sdpa_capable,
)
from worldfoundry.base_models.diffusion_model.optimizations.families import AttentionSite, family_of
from worldfoundry.base_models.diffusion_model.optimizations.plugins import (
    ExecutionLedger,
    PatchRecorder,
    PreparedAcceleration,
    RecordedHandle,
)
from worldfoundry.base_models.diffusion_model.optimizations.refusals import refuse_common, refuse_module_hooks
from worldfoundry.core.acceleration.prepared import ROLE_APPROXIMATE_ATTENTION, ROLE_OFFLOAD
from worldfoundry.core.attention.fused_projection import ProjectionResult, SharedInputProjection
from worldfoundry.core.attention.packed_storage import PackedLinearParameters, check_linears_packable, storage_owners
from worldfoundry.core.attention.sdpa_backends import probe_sdpa_backend, sdpa_backend_scope
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import AccelerationRefusedError, AttentionBackendError, ParameterPackingError
from worldfoundry_optimized_mha.options import PLUGIN_NAME, AttentionOptions, Options

logger = logging.getLogger(__name__)


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Called once by the registry when it discovers this distribution's entry point."""
    register(PLUGIN_NAME, prepare)


@dataclass
class SitePlan:
    """What happens to one attention module."""

    site: AttentionSite
    settings: AttentionOptions
    groups: list[ProjectionGroup] = field(default_factory=list)

    @property
    def backend(self) -> str:
        return self.settings.sdpa_backend

    def sdpa_calls_per_forward(self) -> int:
        # Wan I2V cross-attention attends to the image tokens and to the text tokens: two SDPA calls.
        return 2 if self.site.image_kv else 1

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.site.kind,
            "fusion": self.settings.fusion,
            "sdpa_backend": self.backend,
            "fused_groups": {g.name: list(g.paths()) for g in self.groups},
        }


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
    notes = ["fused projections are checked bitwise against the separate projections on the first call of every "
             "input shape; shapes that differ run the separate projections (reason fused_gemm_not_bitwise)",
             "packed Parameters view one storage: no weight memory is added; uninstall gives them separate storages"]
    for settings in opts.kinds():
        if settings.explicit_backend:
            notes.append(f"sdpa backend {settings.sdpa_backend!r} on {settings.kind}-attention changes rounding")
    if not opts.exact:
        claims.add(ROLE_APPROXIMATE_ATTENTION)
    return PreparedAcceleration(
        name=PLUGIN_NAME,
        claims=frozenset(claims),
        activate=lambda: activate(plans),
        incompatible_with=frozenset({ROLE_OFFLOAD}),
        options=opts.to_json(),
        exact=opts.exact,
        notes=tuple(notes),
    )


def _plan_site(site: AttentionSite, family: Any, settings: AttentionOptions, owners: dict[int, list[str]],
               probed: set[tuple[Any, ...]]) -> SitePlan:
    processor = check_attention_site(site, family, PLUGIN_NAME)
    plan = SitePlan(site, settings)
    if settings.fuses:
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


# ---------------------------------------------------------------------------------------------- activate
class OptimizedMHAHandle(RecordedHandle):
    """Undoes the wrapped forwards and unpacks the storages; reports per-module fused/dense/backend counts."""

    def __init__(self, patches: PatchRecorder, ledger: ExecutionLedger, plans: list[SitePlan],
                 packs: dict[str, PackedLinearParameters], projections: dict[str, SharedInputProjection]) -> None:
        super().__init__(PLUGIN_NAME, patches, ledger)
        self._plans = plans
        self.packs = packs
        self.projections = projections

    def end_request(self, request_id: str) -> None:
        self.ledger.finish(request_id)

    def release(self) -> None:
        for projection in self.projections.values():
            projection.clear()
        self.packs = {}
        self.projections = {}

    def execution_report(self) -> dict[str, Any]:
        report = super().execution_report()
        report["sites"] = {plan.site.path: plan.to_json() for plan in self._plans}
        report["packed_groups"] = {
            key: {"bytes": pack.nbytes, "shares_storage": pack.shares_storage(),
                  "bitwise_checks": self.projections[key].verdicts() if key in self.projections else {}}
            for key, pack in self.packs.items()
        }
        report["added_weight_bytes"] = 0
        return report


def activate(plans: list[SitePlan]) -> OptimizedMHAHandle:
    """Pack, wrap and return the handle. A failure part-way undoes what was done (PatchRecorder)."""
    ledger = ExecutionLedger(PLUGIN_NAME)
    packs: dict[str, PackedLinearParameters] = {}
    projections: dict[str, SharedInputProjection] = {}
    with PatchRecorder(PLUGIN_NAME) as recorder:
        for plan in plans:
            for group in plan.groups:
                key = f"{plan.site.path}:{group.name}"
                pack = PackedLinearParameters.pack(group.modules())
                recorder.callback(pack.unpack, f"unpack {key}")
                packs[key] = pack
                projections[key] = _wrap_group(recorder, group, pack, ledger)
            if plan.settings.explicit_backend:
                recorder.wrap_forward(plan.site.module, _backend_forward(plan, ledger), name=f"{PLUGIN_NAME}.sdpa")
        patches = recorder.pop_all()
    logger.debug("%s active on %d attention module(s)", PLUGIN_NAME, len(plans))
    return OptimizedMHAHandle(patches, ledger, plans, packs, projections)


def _wrap_group(recorder: PatchRecorder, group: ProjectionGroup, pack: PackedLinearParameters,
                ledger: ExecutionLedger) -> SharedInputProjection:
    modules = group.modules()
    paths = group.paths()
    projection = SharedInputProjection(pack.split_sizes, pack.current)
    kind = f"fused_{group.name}"

    def on_result(index: int, result: ProjectionResult | None) -> None:
        if result is None:
            ledger.fallback(paths[index], "unpaired_call")
        elif result.fused:
            ledger.executed(paths[index], kind)
        else:
            ledger.fallback(paths[index], result.reason or "dense")
        if index == 0 and result is not None and result.verified:
            ledger.count("bitwise_checks")
            if not result.fused:
                ledger.count("bitwise_mismatches")

    originals: list[Callable[..., Any]] = [modules[0].forward]
    for index in range(1, len(modules)):
        originals.append(modules[index].forward)
        recorder.wrap_forward(
            modules[index],
            lambda original, i=index: projection.follower_forward(i, original, on_result),
            name=PLUGIN_NAME,
        )

    def make_lead(original: Callable[..., Any]) -> Callable[..., Any]:
        members = [original, *originals[1:]]

        def forward(input: Any) -> Any:
            result = projection.compute(input, members)
            projection.offer(input, result)
            on_result(0, result)
            return result.outputs[0]

        return forward

    recorder.wrap_forward(modules[0], make_lead, name=PLUGIN_NAME)
    return projection


def _backend_forward(plan: SitePlan, ledger: ExecutionLedger) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    backend = plan.backend
    path = plan.site.path
    module = plan.site.module
    calls = plan.sdpa_calls_per_forward()
    kind = f"sdpa_{backend}"

    def make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            dispatch = diffusers_attention_backend(module.processor)
            if dispatch != NATIVE_DIFFUSERS_BACKEND:
                raise AttentionBackendError(
                    backend, f"{path} now dispatches to diffusers attention backend {dispatch!r}, not PyTorch SDPA"
                )
            with sdpa_backend_scope(backend):
                output = original(*args, **kwargs)
            ledger.executed(path, kind, n=calls)
            return output

        return forward

    return make_wrapper


prepare.options_class = Options  # lets tools validate options without a model (worldfoundry bench)
