"""Attention-module knowledge for projection fusion and SDPA backend choice, per model family.

What a plugin needs to know before it touches an attention module:

* which diffusers attention processor computes it (:data:`KNOWN_PROCESSORS`); an unknown processor may call its
  projections differently, so it is refused;
* which projections read the same input and can be packed (:func:`projection_groups`): self-attention
  ``to_q``/``to_k``/``to_v``; cross-attention ``to_k``/``to_v`` (text) and, for Wan I2V, ``add_k_proj``/
  ``add_v_proj`` (image). The first member of a group is the one the processor calls first;
* whether the processor has a fused-projection branch (``if attn.fused_projections:`` then
  ``attn.to_qkv(x).chunk(3, -1)`` / ``attn.to_kv(...)`` / ``attn.to_added_kv(...)``) and which attribute it calls
  for each group (:func:`fused_branch_attributes`);
* whether the attention goes through PyTorch SDPA (softmax attention with diffusers' ``native`` backend) so an
  explicit SDPA backend can apply (:func:`sdpa_capable`);
* for Wan: which model inputs and modules the cross-attention conditioning is computed from, so a static K/V
  cache knows when it is stale (:func:`wan_conditioning_inputs`, :func:`wan_conditioning_modules`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from worldfoundry.base_models.diffusion_model.optimizations.families import (
    AttentionSite,
    ModelFamily,
)
from worldfoundry.errors import AccelerationRefusedError

#: diffusers attention backend name under which processors call ``torch.nn.functional.scaled_dot_product_attention``.
NATIVE_DIFFUSERS_BACKEND: Final = "native"


def _known_processor_classes() -> dict[tuple[str, str], tuple[type, ...]]:
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MiniMaxH3AttnProcessor,
    )
    from diffusers.models.transformers.transformer_sana_video import (
        SanaAttnProcessor2_0,
        SanaLinearAttnProcessor3_0,
    )
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    return {
        ("wan", "self"): (WanAttnProcessor,),
        ("wan", "cross"): (WanAttnProcessor,),
        ("sana_video", "self"): (SanaLinearAttnProcessor3_0,),
        ("sana_video", "cross"): (SanaAttnProcessor2_0,),
        ("minimax_h3", "self"): (MiniMaxH3AttnProcessor,),
    }


#: (family, attention kind) -> names of the diffusers processor classes whose projection calls are known.
KNOWN_PROCESSORS: Final[dict[tuple[str, str], tuple[str, ...]]] = {
    ("wan", "self"): ("WanAttnProcessor",),
    ("wan", "cross"): ("WanAttnProcessor",),
    ("sana_video", "self"): ("SanaLinearAttnProcessor3_0",),
    ("sana_video", "cross"): ("SanaAttnProcessor2_0",),
    ("minimax_h3", "self"): ("MiniMaxH3AttnProcessor",),
}

#: Projection groups per attention kind: (group name, member attribute names in call order).
_GROUPS: Final[dict[str, tuple[tuple[str, tuple[str, ...]], ...]]] = {
    "self": (("qkv", ("to_q", "to_k", "to_v")),),
    "cross": (("kv", ("to_k", "to_v")),),
}
_IMAGE_GROUP: Final = ("added_kv", ("add_k_proj", "add_v_proj"))

#: (family, attention kind) -> {group name: attribute called by the processor's fused branch}. diffusers 0.42.x
#: ``WanAttnProcessor`` (``_get_qkv_projections`` / ``_get_added_kv_projections``) and ``MiniMaxH3AttnProcessor``
#: check ``attn.fused_projections``; SANA-Video's processors have no fused branch.
FUSED_BRANCH_ATTRIBUTES: Final[dict[tuple[str, str], dict[str, str]]] = {
    ("wan", "self"): {"qkv": "to_qkv"},
    ("wan", "cross"): {"kv": "to_kv", "added_kv": "to_added_kv"},
    ("minimax_h3", "self"): {"qkv": "to_qkv"},
}
#: Every attribute name a diffusers fused branch reads (present on a module = someone fused it already).
FUSED_ATTRIBUTE_NAMES: Final = ("to_qkv", "to_kv", "to_added_kv")


@dataclass(frozen=True)
class ProjectionGroup:
    """Linears of one attention module that read the same input.

    Attributes:
        name: ``"qkv"`` (self-attention), ``"kv"`` (cross-attention text) or ``"added_kv"`` (Wan I2V image).
        site: the attention module.
        members: attribute names, the one the processor calls first leading.
    """

    name: str
    site: AttentionSite
    members: tuple[str, ...]

    def modules(self) -> tuple[nn.Module, ...]:
        return tuple(getattr(self.site.module, m) for m in self.members)

    def paths(self) -> tuple[str, ...]:
        return tuple(self.site.projection_path(m) for m in self.members)

    def named_modules(self) -> list[tuple[str, nn.Module]]:
        return list(zip(self.paths(), self.modules(), strict=True))


def check_attention_site(site: AttentionSite, family: ModelFamily, plugin: str) -> Any:
    """Refuse attention modules whose computation is not the one this module describes.

    Args:
        site: the attention module.
        family: its model family.
        plugin: the refusing plugin's name.

    Returns:
        The module's processor.

    Raises:
        AccelerationRefusedError: unknown/custom processor, or diffusers' own fused projections are active.
    """
    processor = check_known_processor(site, family, plugin)
    if getattr(site.module, "fused_projections", False):
        raise AccelerationRefusedError(
            plugin, f"{site.path} has diffusers' fused projections active; call model.unfuse_qkv_projections() first"
        )
    return processor


def check_known_processor(site: AttentionSite, family: ModelFamily, plugin: str) -> Any:
    """Refuse attention modules whose processor is not one of :data:`KNOWN_PROCESSORS` (a custom processor may
    compute attention differently).

    Returns:
        The module's processor.

    Raises:
        AccelerationRefusedError: unknown/custom processor.
    """
    processor = getattr(site.module, "processor", None)
    known = _known_processor_classes().get((family.name, site.kind), ())
    if type(processor) not in known:
        names = ", ".join(KNOWN_PROCESSORS.get((family.name, site.kind), ())) or "none"
        raise AccelerationRefusedError(
            plugin,
            f"{site.path} uses attention processor {type(processor).__name__}, which {plugin} does not know "
            f"(known for {family.name} {site.kind}-attention: {names}); restore the default processor first",
        )
    return processor


def projection_groups(site: AttentionSite, *, include_image: bool = True) -> list[ProjectionGroup]:
    """The packable projection groups of ``site`` (self: ``qkv``; cross: ``kv`` and, if present, ``added_kv``)."""
    groups = [ProjectionGroup(name, site, members) for name, members in _GROUPS[site.kind]]
    if site.kind == "cross" and include_image and site.image_kv:
        groups.append(ProjectionGroup(_IMAGE_GROUP[0], site, _IMAGE_GROUP[1]))
    return groups


def fused_branch_attributes(site: AttentionSite, family: ModelFamily) -> dict[str, str] | None:
    """The attribute the site's processor calls for each of its projection groups when
    ``attn.fused_projections`` is true, or ``None`` when that branch cannot serve the site.

    It serves a site only if the processor has the branch, every group of the site (:func:`projection_groups`)
    has an attribute there (the branch replaces all of them at once) and, for Wan, the module's
    ``is_cross_attention`` (which picks ``to_qkv`` vs ``to_kv``) agrees with the site's kind.
    Call :func:`check_attention_site` first (it checks the processor class).
    """
    attributes = FUSED_BRANCH_ATTRIBUTES.get((family.name, site.kind))
    if attributes is None:
        return None
    if family.name == "wan" and bool(getattr(site.module, "is_cross_attention", None)) != (site.kind == "cross"):
        return None
    groups = [g.name for g in projection_groups(site)]
    if any(g not in attributes for g in groups):
        return None
    return {g: attributes[g] for g in groups}


def diffusers_attention_backend(processor: Any) -> str:
    """The diffusers attention backend the processor dispatches to (its own, else the globally active one)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    backend = getattr(processor, "_attention_backend", None)
    if backend is None:
        backend = _AttentionBackendRegistry.get_active_backend()[0]
    return str(getattr(backend, "value", backend))


def sdpa_capable(site: AttentionSite, processor: Any) -> str | None:
    """Why an explicit SDPA backend cannot apply to ``site`` (``None`` when it can).

    It applies to softmax attention whose processor dispatches to diffusers' ``native`` backend, i.e. calls
    ``torch.nn.functional.scaled_dot_product_attention``.
    """
    if not site.softmax:
        return f"{site.path} is linear attention and calls no scaled-dot-product attention"
    backend = diffusers_attention_backend(processor)
    if backend != NATIVE_DIFFUSERS_BACKEND:
        return (
            f"{site.path} dispatches to diffusers attention backend {backend!r}, not {NATIVE_DIFFUSERS_BACKEND!r} "
            "(PyTorch SDPA); set the diffusers attention backend back to 'native' or keep sdpa_backend='torch'"
        )
    return None


def head_dim(site: AttentionSite) -> int:
    """Head size of the attention's queries."""
    heads = int(site.module.heads)
    return site.module.to_q.out_features // heads


def wan_conditioning_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that turn Wan's conditioning inputs into the cross-attention context (text and image embedders)."""
    embedder = getattr(model, "condition_embedder", None)
    found = []
    for name in ("text_embedder", "image_embedder"):
        module = getattr(embedder, name, None) if embedder is not None else None
        if module is not None:
            found.append((f"condition_embedder.{name}", module))
    return found


_WAN_CONDITIONING_ARGS: Final = ("encoder_hidden_states", "encoder_hidden_states_image")


def wan_conditioning_positions(model: nn.Module) -> dict[str, int]:
    """Positional index of each Wan conditioning argument in ``model.forward`` (without ``self``)."""
    names = [p.name for p in inspect.signature(model.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {name: names.index(name) for name in _WAN_CONDITIONING_ARGS if name in names}


def wan_conditioning_inputs(positions: Mapping[str, int], args: tuple[Any, ...],
                            kwargs: Mapping[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The text and image conditioning tensors of one Wan forward call.

    Args:
        positions: :func:`wan_conditioning_positions` of the model.
        args, kwargs: the call's arguments.

    Returns:
        ``(encoder_hidden_states, encoder_hidden_states_image)``, ``None`` where absent.
    """
    found: list[torch.Tensor | None] = []
    for name in _WAN_CONDITIONING_ARGS:
        value = kwargs.get(name)
        if value is None and name in positions and positions[name] < len(args):
            value = args[positions[name]]
        found.append(value if isinstance(value, torch.Tensor) else None)
    return found[0], found[1]


__all__ = [
    "FUSED_ATTRIBUTE_NAMES",
    "FUSED_BRANCH_ATTRIBUTES",
    "KNOWN_PROCESSORS",
    "NATIVE_DIFFUSERS_BACKEND",
    "ProjectionGroup",
    "check_attention_site",
    "check_known_processor",
    "diffusers_attention_backend",
    "fused_branch_attributes",
    "head_dim",
    "projection_groups",
    "sdpa_capable",
    "wan_conditioning_inputs",
    "wan_conditioning_modules",
    "wan_conditioning_positions",
]
