"""What ``optimized_mha`` will do to one attention module, decided at prepare time (nothing is changed here).

Two ways to run a packed projection group:

* :data:`FUSED_BRANCH` — the processor's own fused-projection branch (diffusers Wan and MiniMax-H3 processors:
  ``if attn.fused_projections: attn.to_qkv(x).chunk(3, -1)``). The plugin sets ``attn.fused_projections = True``
  and gives the module a plain callable ``to_qkv`` / ``to_kv`` / ``to_added_kv``
  (:class:`~worldfoundry.core.attention.packed_projection.PackedProjection`): one Python call and one GEMM per
  group, the member Linears are not called at all.
* :data:`PROJECTION_WRAPPERS` — for processors without that branch (SANA-Video) or groups it cannot serve:
  every member's ``forward`` is wrapped; the first runs the packed GEMM and the others take their slice
  (:class:`~worldfoundry.core.attention.fused_projection.SharedInputProjection`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from worldfoundry.base_models.diffusion_model.optimizations.attention_sites import (
    FUSED_ATTRIBUTE_NAMES,
    ProjectionGroup,
    fused_branch_attributes,
)
from worldfoundry.plugin import AccelerationRefusedError, AttentionSite, ModelFamily
from worldfoundry_optimized_mha.options import PLUGIN_NAME, AttentionOptions

FUSED_BRANCH: Final = "diffusers_fused_branch"
PROJECTION_WRAPPERS: Final = "projection_wrappers"


@dataclass
class SitePlan:
    """What happens to one attention module.

    Attributes:
        site: the attention module.
        settings: the options of its attention kind.
        groups: the projection groups to pack (empty without fusion).
        projection_path: :data:`FUSED_BRANCH` or :data:`PROJECTION_WRAPPERS` (``None`` without fusion).
        path_reason: why the wrappers are used where the fused branch is not.
        branch_attributes: group name -> attribute the fused branch calls (``FUSED_BRANCH`` only).
    """

    site: AttentionSite
    settings: AttentionOptions
    groups: list[ProjectionGroup] = field(default_factory=list)
    projection_path: str | None = None
    path_reason: str | None = None
    branch_attributes: dict[str, str] = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return self.settings.sdpa_backend

    def sdpa_calls_per_forward(self) -> int:
        # Wan I2V cross-attention attends to the image tokens and to the text tokens: two SDPA calls.
        return 2 if self.site.image_kv else 1

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.site.kind,
            "fusion": self.settings.fusion,
            "sdpa_backend": self.backend,
            "fused_groups": {g.name: list(g.paths()) for g in self.groups},
            "projection_path": self.projection_path,
        }
        if self.projection_path == FUSED_BRANCH:
            out["fused_branch_attributes"] = dict(self.branch_attributes)
        if self.path_reason is not None:
            out["projection_path_reason"] = self.path_reason
        return out


def refuse_diffusers_fused(site: AttentionSite) -> None:
    """Refuse a module that already carries diffusers' fused projections (``fuse_qkv_projections()``).

    Raises:
        AccelerationRefusedError: naming the attribute found.
    """
    module = site.module
    for name in FUSED_ATTRIBUTE_NAMES:
        if name in module._modules or name in module.__dict__:
            raise AccelerationRefusedError(
                PLUGIN_NAME,
                f"{site.path}.{name} exists: diffusers' fused projections were created on this module "
                "(fuse_qkv_projections); call model.unfuse_qkv_projections() and remove it first",
            )


def choose_projection_path(plan: SitePlan, family: ModelFamily) -> None:
    """Fill ``plan.projection_path`` (and the branch attributes or the reason for the wrappers)."""
    if not plan.groups:
        return
    attributes = fused_branch_attributes(plan.site, family)
    reason = None
    if attributes is None:
        reason = f"the {family.name} {plan.site.kind}-attention processor has no fused-projection branch"
    else:
        unequal = [g.name for g in plan.groups if len({m.out_features for m in g.modules()}) != 1]
        if unequal:
            reason = f"group(s) {unequal} have unequal out_features; the fused branch splits with chunk()"
        elif {g.name for g in plan.groups} != set(attributes):
            reason = f"the fused branch replaces groups {sorted(attributes)} together"
    if reason is None and attributes is not None:
        plan.projection_path = FUSED_BRANCH
        plan.branch_attributes = attributes
    else:
        plan.projection_path = PROJECTION_WRAPPERS
        plan.path_reason = reason


def path_summary(plans: list[SitePlan]) -> dict[str, int]:
    """Number of attention modules per projection path."""
    summary: dict[str, int] = {}
    for plan in plans:
        if plan.projection_path is not None:
            summary[plan.projection_path] = summary.get(plan.projection_path, 0) + 1
    return summary
