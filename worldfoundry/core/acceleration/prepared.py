"""The plugin protocol: a factory validates and returns a :class:`PreparedAcceleration`; ``activate()`` returns a handle."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch.nn as nn

    from worldfoundry.core.model_loading.policy import RuntimePolicy

#: Module-path claim for the model's own ``forward`` (the root module).
ROOT_MODULE: Final = "<root>"
#: Prefix of role claims, e.g. ``role:feature_cache``; two plugins with the same role conflict.
ROLE_PREFIX: Final = "role:"


#: Well-known roles. Plugins claim the roles they take and list the roles they cannot run beside in
#: ``incompatible_with``, so conflicts are found without plugins importing each other.
ROLE_FEATURE_CACHE: Final = "role:feature_cache"  # step/block output caching (EasyCache, FirstBlockCache)
ROLE_STATIC_KV_CACHE: Final = "role:static_kv_cache"  # per-request cached cross-attention K/V
ROLE_OFFLOAD: Final = "role:offload"  # block weights leave the compute device between uses
ROLE_QUANTIZATION: Final = "role:quantization"  # weights executed in another precision (FP8, INT4)
ROLE_APPROXIMATE_ATTENTION: Final = "role:approximate_attention"  # attention kernels with new rounding/sparsity
ROLE_ATTENTION_ADAPTER: Final = "role:attention_adapter"  # LoRA-style adapters on attention projections
ROLE_WEIGHT_VIEW: Final = "role:weight_view"  # the model is an inference view of changed weights


def role(name: str) -> str:
    """The claim string for a role (``role("offload") == "role:offload"``)."""
    return ROLE_PREFIX + name


def is_role(claim: str) -> bool:
    return claim.startswith(ROLE_PREFIX)


@runtime_checkable
class AccelerationHandle(Protocol):
    """What ``activate()`` returns. Only ``deactivate`` is required.

    Optional methods the session calls when present:
    ``execution_report() -> dict``, ``begin_request(request_id)``, ``end_request(request_id)``,
    ``prepare_request_schedule(request_id, schedule)``.
    """

    def deactivate(self) -> None:  # exact restore, idempotent
        ...


@dataclass(frozen=True)
class PreparedAcceleration:
    """A validated plan. Creating it must not change the model.

    Args:
        name: the acceleration's spec key.
        claims: module paths (relative to the model, ``"<root>"`` for the model itself) and roles
            (``"role:feature_cache"``) this acceleration will change. Two accelerations sharing a claim conflict.
        activate: performs the recorded, reversible change and returns an :class:`AccelerationHandle`.
        incompatible_with: names of other accelerations, or claims (e.g. ``"role:offload"``), this one cannot
            run together with. Checked in both directions before anything is activated.
        options: the resolved options, JSON-serialisable, for the install receipt.
        exact: ``True`` when the output is claimed bitwise identical to the dense model, ``False`` when it is
            approximate, ``None`` when it depends on the request.
        notes: short human-readable facts for the receipt (e.g. "sdpa backend cudnn changes rounding").
    """

    name: str
    claims: frozenset[str]
    activate: Callable[[], AccelerationHandle]
    incompatible_with: frozenset[str] = frozenset()
    options: Mapping[str, Any] = field(default_factory=dict)
    exact: bool | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from worldfoundry.errors import AccelerationOptionsError

        if not isinstance(self.name, str) or not self.name:
            raise AccelerationOptionsError(str(self.name), "PreparedAcceleration.name must be a non-empty string")
        object.__setattr__(self, "claims", frozenset(self.claims))
        object.__setattr__(self, "incompatible_with", frozenset(self.incompatible_with))
        if not callable(self.activate):
            raise AccelerationOptionsError(self.name, "PreparedAcceleration.activate must be callable")
        for claim in self.claims:
            if not isinstance(claim, str) or not claim:
                raise AccelerationOptionsError(self.name, f"claims must be non-empty strings, got {claim!r}")


class PrepareFactory(Protocol):
    def __call__(self, model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
        ...
