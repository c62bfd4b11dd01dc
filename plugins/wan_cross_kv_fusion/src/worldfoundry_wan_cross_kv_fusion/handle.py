"""Runtime of ``wan_cross_kv_fusion``: packed cross-attention K/V projections and the static K/V cache.

Per cross-attention module and group (``text``: ``to_k``/``to_v``; ``image``: ``add_k_proj``/``add_v_proj``):

* the lead projection (``to_k`` / ``add_k_proj``) runs one GEMM on a derived packed weight (refreshed when a
  source Parameter changes) and hands the value slice to the follower (``to_v`` / ``add_v_proj``);
* inside a request (``current_request()``) and a model forward, the pair of outputs is cached per
  (request id, CFG branch, expert, module, group) and reused while the conditioning inputs of the model call
  (identity, version, pointer, layout), the parameters of the text/image embedders and the K/V weights are
  unchanged;
* fewer key/value tokens than ``min_tokens``: the original projections run (dense bypass, counted).

The conditioning of the running forward is captured by a forward pre-hook on the model (and released by an
always-called forward hook), because the cross-attention input itself is recomputed by the embedders on every
call while the model inputs stay the same tensors over the steps of a request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from worldfoundry.base_models.diffusion_model.optimizations.attention_sites import (
    ProjectionGroup,
    wan_conditioning_inputs,
)
from worldfoundry.base_models.diffusion_model.optimizations.plugins import (
    ExecutionLedger,
    PatchRecorder,
    RecordedHandle,
)
from worldfoundry.core.acceleration.context import current_request
from worldfoundry.core.attention.fingerprints import ContentVersions, parameters_state, tensor_state
from worldfoundry.core.attention.fused_projection import ProjectionResult, SharedInputProjection
from worldfoundry.core.attention.packed_storage import DerivedPackedLinear
from worldfoundry.core.attention.static_kv_cache import StaticKVCache
from worldfoundry_wan_cross_kv_fusion.options import PLUGIN_NAME, Options

#: Ledger kind suffix per projection group.
GROUP_KINDS = {"kv": "text_kv", "added_kv": "image_kv"}

BELOW_MIN_TOKENS = "below_min_tokens"


@dataclass
class PackedGroup:
    """One packed K/V pair and its runtime objects."""

    group: ProjectionGroup
    pack: DerivedPackedLinear
    projection: SharedInputProjection
    paths: tuple[str, ...]

    @property
    def kind(self) -> str:
        return GROUP_KINDS[self.group.name]

    @property
    def key(self) -> str:
        return f"{self.group.site.path}:{self.kind}"


class WanCrossKVHandle(RecordedHandle):
    """Holds the packed copies, the static K/V cache and the per-forward conditioning; reports receipts."""

    def __init__(self, model: nn.Module, opts: Options, conditioning_modules: Sequence[tuple[str, nn.Module]],
                 positions: Mapping[str, int], *, max_requests: int = 8) -> None:
        super().__init__(PLUGIN_NAME, PatchRecorder(PLUGIN_NAME), ExecutionLedger(PLUGIN_NAME))
        self.opts = opts
        self._model_class = type(model).__name__
        self._conditioning_modules = [m for _, m in conditioning_modules]
        self._positions = dict(positions)
        self.cache = StaticKVCache(max_requests=max_requests)
        self.groups: dict[str, PackedGroup] = {}
        self._versions = ContentVersions()
        self._local = threading.local()

    # ------------------------------------------------------------------ lifecycle
    def begin_request(self, request_id: str) -> None:
        self.cache.drop_request(request_id)

    def end_request(self, request_id: str) -> None:
        dropped = self.cache.drop_request(request_id)
        self.ledger.note("kv_cache_entries_dropped", dropped, request_id=request_id)
        self.ledger.finish(request_id)

    def release(self) -> None:
        self.cache.clear()
        self._versions.clear()
        for packed in self.groups.values():
            packed.pack.release()
            packed.projection.clear()
        self.groups = {}

    def execution_report(self) -> dict[str, Any]:
        report = super().execution_report()
        report["packed_groups"] = {
            key: {"paths": list(g.paths), "derived_bytes": g.pack.nbytes, "builds": g.pack.builds,
                  "bitwise_checks": g.projection.verdicts()}
            for key, g in self.groups.items()
        }
        report["derived_weight_bytes"] = sum(g.pack.nbytes for g in self.groups.values())
        report["kv_cache"] = {"entries": self.cache.entries(), "bytes": self.cache.nbytes(),
                              "evicted_requests": self.cache.evicted_requests}
        report["options"] = self.opts.to_json()
        return report

    # ------------------------------------------------------------------ conditioning of the running forward
    def enter_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook on the model: remember what the cross-attention context is computed from."""
        text, image = wan_conditioning_inputs(self._positions, args, kwargs)
        key: tuple[Any, ...] | None = None
        if text is not None:
            key = (
                tensor_state(text, self._versions.version(text)),
                tensor_state(image, self._versions.version(image)) if image is not None else (),
                parameters_state(self._conditioning_modules),
            )
        stack = self._stack()
        stack.append(key)

    def exit_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Always-called forward hook on the model: forget the forward's conditioning."""
        stack = self._stack()
        if stack:
            stack.pop()

    def _stack(self) -> list[tuple[Any, ...] | None]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _conditioning(self) -> tuple[Any, ...] | None:
        stack = self._stack()
        return stack[-1] if stack else None

    # ------------------------------------------------------------------ projections
    def add_group(self, recorder: PatchRecorder, group: ProjectionGroup) -> PackedGroup:
        """Wrap the group's projections (lead: packed/cached; follower: its slice)."""
        modules = group.modules()
        pack = DerivedPackedLinear(modules)
        packed = PackedGroup(group, pack, SharedInputProjection(pack.split_sizes, pack.current), group.paths())
        self.groups[packed.key] = packed
        originals: list[Callable[..., Any]] = [modules[0].forward]
        for index in range(1, len(modules)):
            originals.append(modules[index].forward)
            recorder.wrap_forward(
                modules[index],
                lambda original, i=index: packed.projection.follower_forward(
                    i, original, lambda idx, res: self._record(packed, idx, res)),
                name=PLUGIN_NAME,
            )

        def make_lead(original: Callable[..., Any]) -> Callable[..., Any]:
            members = [original, *originals[1:]]

            def forward(input: Any) -> Any:
                return self._lead(packed, input, members)

            return forward

        recorder.wrap_forward(modules[0], make_lead, name=PLUGIN_NAME)
        return packed

    def _lead(self, packed: PackedGroup, x: torch.Tensor, members: Sequence[Callable[..., Any]]) -> torch.Tensor:
        projection = packed.projection
        tokens = x.shape[-2] if x.dim() >= 2 else 1
        if tokens < self.opts.min_tokens:
            result = ProjectionResult(tuple(m(x) for m in members), False, BELOW_MIN_TOKENS)
            self.ledger.count("dense_bypass")
        else:
            result = self._cached_or_computed(packed, x, members)
        projection.offer(x, result)
        self._record(packed, 0, result)
        return result.outputs[0]

    def _cached_or_computed(self, packed: PackedGroup, x: torch.Tensor,
                            members: Sequence[Callable[..., Any]]) -> ProjectionResult:
        ctx = current_request()
        conditioning = self._conditioning()
        if ctx is None or conditioning is None:
            self.ledger.count("kv_cache_unscoped")
            return packed.projection.compute(x, members)
        slot = (ctx.branch, ctx.expert, packed.key)
        validity = (conditioning, packed.pack.source_state(), tuple(x.shape), x.dtype, x.device)
        cached, status = self.cache.lookup(ctx.request_id, slot, validity)
        branch = ctx.branch or "none"
        if cached is not None:
            self.ledger.count("kv_cache_hit")
            self.ledger.count(f"kv_cache_hit.{branch}")
            return ProjectionResult(cached, True, cached=True)
        self.ledger.count(f"kv_cache_{status}")
        self.ledger.count(f"kv_cache_miss.{branch}")
        if status != "miss":
            self.ledger.count("kv_cache_miss")
        result = packed.projection.compute(x, members)
        self.cache.store(ctx.request_id, slot, validity, result.outputs)
        return result

    def _record(self, packed: PackedGroup, index: int, result: ProjectionResult | None) -> None:
        path = packed.paths[index]
        if result is None:
            self.ledger.fallback(path, "unpaired_call")
            return
        if result.cached:
            self.ledger.executed(path, f"cached_{packed.kind}")
        elif result.fused:
            self.ledger.executed(path, f"packed_{packed.kind}")
        else:
            self.ledger.fallback(path, result.reason or "dense")
        if index == 0 and result.verified:
            self.ledger.count("bitwise_checks")
            if not result.fused:
                self.ledger.count("bitwise_mismatches")


__all__ = ["BELOW_MIN_TOKENS", "GROUP_KINDS", "PackedGroup", "WanCrossKVHandle"]
