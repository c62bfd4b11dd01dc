"""What ``wan_cross_kv_fusion`` keeps per K/V group, per (request, CFG branch, expert) and per model forward."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from worldfoundry.base_models.diffusion_model.optimizations.attention_sites import ProjectionGroup
from worldfoundry.core.attention.fused_projection import SharedInputProjection
from worldfoundry.core.attention.packed_storage import DerivedPackedLinear
from worldfoundry.core.attention.static_kv_cache import CacheEntry

#: Ledger kind suffix per projection group.
GROUP_KINDS = {"kv": "text_kv", "added_kv": "image_kv"}
#: The module the Wan processor normalises each group's key with.
KEY_NORMS = {"kv": "norm_k", "added_kv": "norm_added_k"}

BELOW_MIN_TOKENS = "below_min_tokens"
#: ``pack=False``: the original projections computed the pair (not a fallback: the configured path).
PACK_DISABLED = "pack_disabled"


@dataclass
class PackedGroup:
    """One K/V pair and its runtime objects (``pack`` is ``None`` with ``pack=False``)."""

    index: int
    group: ProjectionGroup
    pack: DerivedPackedLinear | None
    projection: SharedInputProjection
    paths: tuple[str, ...]
    norm_path: str | None = None

    @property
    def kind(self) -> str:
        return GROUP_KINDS[self.group.name]

    @property
    def key(self) -> str:
        return f"{self.group.site.path}:{self.kind}"


@dataclass
class BranchState:
    """One (request, CFG branch, expert): its conditioning epoch, cache slots and plain hit counters."""

    request_id: str
    branch: str
    slots: list[Hashable]
    hits: list[int]
    follows: list[int]
    norm_hits: list[int]
    conditioning: tuple[Any, ...] | None = None
    epoch: int = 0


@dataclass
class ForwardGrant:
    """What the calls of the validated forward running now (in ``owner``'s thread) may use."""

    owner: int
    state: BranchState
    entries: dict[Hashable, CacheEntry]
    gens: list[int]
    handoff: tuple[int, torch.Tensor, torch.Tensor] | None = None
    #: (cached key, its cached normalisation) for the next key-norm call
    norm_handoff: tuple[torch.Tensor, torch.Tensor] | None = None
    #: (group index, key just computed) whose normalisation is to be cached
    norm_pending: tuple[int, torch.Tensor] | None = None


__all__ = ["BELOW_MIN_TOKENS", "GROUP_KINDS", "KEY_NORMS", "PACK_DISABLED", "BranchState", "ForwardGrant",
           "PackedGroup"]
