"""Glue: registration, ``prepare`` (validation only) and ``activate`` of ``wan_cross_kv_fusion``.

``prepare`` checks that the model is a Wan transformer with the stock attention processor, that its cross-attention
K/V projections are plain float Linears without hooks, and claims those projections plus
``role:static_kv_cache`` (so any other plugin selecting the same K/V — e.g. ``selective_fp8`` — conflicts before
activation, whatever the order in the spec). ``activate`` wraps the projections and adds a forward pre-hook and an
always-called forward hook on the model (all recorded); the runtime lives in :mod:`.handle`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.nn as nn

import worldfoundry
from worldfoundry.base_models.diffusion_model.optimizations.attention_sites import (
    ProjectionGroup,
    check_attention_site,
    projection_groups,
    wan_conditioning_modules,
    wan_conditioning_positions,
)
from worldfoundry.base_models.diffusion_model.optimizations.guards import install_call_refusals
from worldfoundry.core.attention.packed_storage import check_linears_packable
from worldfoundry.plugin import (
    ROLE_OFFLOAD,
    ROLE_STATIC_KV_CACHE,
    AccelerationRefusedError,
    AttentionSite,
    ModelFamily,
    ParameterPackingError,
    PatchRecorder,
    PreparedAcceleration,
    RuntimePolicy,
    family_of,
    refuse_common,
    refuse_module_hooks,
)
from worldfoundry_wan_cross_kv_fusion.handle import KEY_NORMS, WanCrossKVHandle
from worldfoundry_wan_cross_kv_fusion.options import PLUGIN_NAME, Options

logger = logging.getLogger(__name__)


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Called once by the registry when it discovers this distribution's entry point."""
    register(PLUGIN_NAME, prepare, options=Options)


def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
    """Validate ``options`` against ``model``; change nothing.

    Raises:
        AccelerationOptionsError: unknown or invalid options.
        AccelerationRefusedError: not a Wan transformer; compiled / CUDA-graph / sequence-parallel / hooked /
            training model; unknown attention processor or diffusers' fused projections; K/V projections that
            are not plain float Linears of one dtype/device; ``include_image`` on a model without image K/V.
    """
    opts = Options.from_mapping(options)
    family = family_of(model, plugin=PLUGIN_NAME)
    if family.name != "wan":
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"only Wan transformers have the text cross-attention this plugin packs, got {family.name}"
        )
    refuse_common(model, PLUGIN_NAME)
    sites = family.attention_sites(model, kinds=("cross",))
    if not sites:
        raise AccelerationRefusedError(PLUGIN_NAME, f"{type(model).__name__} has no cross-attention")
    if opts.include_image and not any(site.image_kv for site in sites):
        raise AccelerationRefusedError(
            PLUGIN_NAME, "include_image=True but the model has no image K/V projections (not an I2V model)"
        )
    groups, norms = _packable_groups(sites, family, include_image=opts.include_image)
    derived_bytes = _weight_bytes(groups) if opts.pack else 0
    claims = {path for g in groups for path in g.paths()} | {path for path, _ in norms.values()}
    claims.add(ROLE_STATIC_KV_CACHE)
    return PreparedAcceleration(
        name=PLUGIN_NAME,
        claims=frozenset(claims),
        activate=lambda: activate(model, opts, groups, norms),
        incompatible_with=frozenset({ROLE_OFFLOAD}),
        options=opts.to_json(),
        exact=True,
        notes=(
            (f"derived packed K/V weights add {derived_bytes} bytes; the original Parameters are kept"
             if opts.pack else "pack=False: no derived weights (0 bytes added); the original projections compute "
             "what the cache does not hold"),
            "static K/V (and the normalised K) computed once per (request, CFG branch, expert) and reused while "
            "the conditioning inputs and weights are unchanged",
            ("packed K/V checked bitwise against the separate projections on the first call of every input shape"
             if opts.pack else "exact by construction: cached outputs of the original projections"),
        ),
    )


def _packable_groups(sites: Sequence[AttentionSite], family: ModelFamily, *, include_image: bool
                     ) -> tuple[list[ProjectionGroup], dict[int, tuple[str, nn.Module]]]:
    """The K/V projection groups of every cross-attention site and, by group index, their key norms.

    Raises:
        AccelerationRefusedError: an unknown processor, hooks on a projection or its norm, or projections
            that cannot be packed (named with the site).
    """
    groups: list[ProjectionGroup] = []
    norms: dict[int, tuple[str, nn.Module]] = {}
    for site in sites:
        check_attention_site(site, family, PLUGIN_NAME)
        for group in projection_groups(site, include_image=include_image):
            named = group.named_modules()
            norm = key_norm(group)
            if norm is not None:
                named = [*named, norm]
                norms[len(groups)] = norm
            refuse_module_hooks(named, PLUGIN_NAME)
            try:
                check_linears_packable(group.named_modules(), share_storage=False)
            except ParameterPackingError as exc:
                raise AccelerationRefusedError(PLUGIN_NAME, f"cannot pack {group.name} of {site.path}: {exc}") from exc
            groups.append(group)
    return groups, norms


def _weight_bytes(groups: Sequence[ProjectionGroup]) -> int:
    """Bytes of the groups' weights and biases (what packed copies add)."""
    return sum(m.weight.numel() * m.weight.element_size()
               + (m.bias.numel() * m.bias.element_size() if m.bias is not None else 0)
               for g in groups for m in g.modules())


def key_norm(group: ProjectionGroup) -> tuple[str, nn.Module] | None:
    """``(path, module)`` of the normalisation the Wan processor applies to the group's key, when it is one whose
    output depends only on its input and its own parameters (RMSNorm / LayerNorm); ``None`` otherwise."""
    from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

    name = KEY_NORMS[group.name]
    module = getattr(group.site.module, name, None)
    if not isinstance(module, (nn.RMSNorm, nn.LayerNorm, DiffusersRMSNorm)):
        return None
    return group.site.projection_path(name), module


def activate(model: nn.Module, opts: Options, groups: list[ProjectionGroup],
             norms: Mapping[int, tuple[str, nn.Module]]) -> WanCrossKVHandle:
    """Wrap the K/V projections and hook the model forward; undone on failure part-way."""
    handle = WanCrossKVHandle(model, opts, wan_conditioning_modules(model), wan_conditioning_positions(model))
    with PatchRecorder(PLUGIN_NAME) as recorder:
        recorder.hook(model.register_forward_pre_hook(handle.enter_forward, with_kwargs=True),
                      f"{PLUGIN_NAME} conditioning pre-hook")
        recorder.hook(model.register_forward_hook(handle.exit_forward, always_call=True),
                      f"{PLUGIN_NAME} conditioning hook")
        for i, group in enumerate(groups):
            norm_path, norm = norms.get(i, (None, None))
            handle.add_group(recorder, group, norm, norm_path)
        fusion = "diffusers' fused to_kv projection would bypass the packed K/V and its static cache"
        install_call_refusals(recorder, model, {"fuse_qkv_projections": fusion}, plugin=PLUGIN_NAME)
        for site in {id(g.site.module): g.site for g in groups}.values():
            install_call_refusals(recorder, site.module, {"fuse_projections": fusion}, plugin=PLUGIN_NAME,
                                  where=f"module {site.path!r}")
        if opts.pack:  # the packed copy has one dtype; per-layer casting would split its sources
            install_call_refusals(recorder, model, {
                "enable_layerwise_casting": "it recasts the K/V weights wan_cross_kv_fusion packs into one copy",
            }, plugin=PLUGIN_NAME)
        handle.patches = recorder.pop_all()
    logger.debug("%s active on %d K/V group(s)", PLUGIN_NAME, len(groups))
    return handle
