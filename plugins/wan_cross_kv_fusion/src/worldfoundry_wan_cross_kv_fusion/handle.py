"""Runtime of ``wan_cross_kv_fusion``: packed cross-attention K/V projections and the static K/V cache.

Per cross-attention module and group (``text``: ``to_k``/``to_v``; ``image``: ``add_k_proj``/``add_v_proj``):

* the lead projection (``to_k`` / ``add_k_proj``) computes both outputs — one GEMM on a derived packed weight
  (refreshed when a source Parameter changes), or with ``pack=False`` the original projections — and hands the
  value to the follower (``to_v`` / ``add_v_proj``);
* inside a request (``current_request()``) the pair is cached per (request id, CFG branch, expert, module, group)
  and reused while the conditioning inputs of the model call (identity, version, pointer, layout), the parameters
  of the text/image embedders and the K/V weights are unchanged; cached tensors are contiguous, so the processor's
  ``norm_k`` reads them exactly as it reads the dense projection's output;
* the key normalisation the processor applies next (``norm_k`` / ``norm_added_k``) is static too: its output for
  a cached key is cached with it (its weight is part of the validity key) and handed back when the processor
  normalises that very key tensor again;
* fewer key/value tokens than ``min_tokens``: the original projections run (dense bypass, counted).

At a few thousand tokens a Wan forward is bound by the host as much as by the GPU, so everything that can be
decided once per model forward is: a forward pre-hook on the model reads the conditioning, the request context
and the K/V weights' generations (:class:`~worldfoundry.core.attention.source_watch.LinearSourceWatch`), and —
when this is the only forward running on the model — lets the projection calls of that forward, in that thread,
serve a valid entry with one dict lookup and count it with a plain integer (folded into the ledger at request end
or report). A concurrent second forward revokes that; its calls, and calls outside a request, compute without the
cache. A change made while a forward runs is seen from the next forward on.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from worldfoundry.base_models.diffusion_model.optimizations.attention_sites import (
    ProjectionGroup,
    wan_conditioning_inputs,
)
from worldfoundry.core.attention.fingerprints import ContentVersions, parameters_state, tensor_state
from worldfoundry.core.attention.fused_projection import ProjectionResult, SharedInputProjection
from worldfoundry.core.attention.packed_storage import DerivedPackedLinear
from worldfoundry.core.attention.source_watch import LinearSourceWatch
from worldfoundry.core.attention.static_kv_cache import CacheEntry, StaticKVCache
from worldfoundry.plugin import ExecutionLedger, PatchRecorder, RecordedHandle, RequestContext, current_request
from worldfoundry_wan_cross_kv_fusion.options import PLUGIN_NAME, Options
from worldfoundry_wan_cross_kv_fusion.runtime_state import (
    BELOW_MIN_TOKENS,
    GROUP_KINDS,
    KEY_NORMS,
    PACK_DISABLED,
    BranchState,
    ForwardGrant,
    PackedGroup,
)

_get_ident = threading.get_ident


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
        self._order: list[PackedGroup] = []
        self._watch: LinearSourceWatch | None = None
        self._watched: list[tuple[nn.Module, ...]] = []
        self._versions = ContentVersions()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._active = 0
        self._fast: ForwardGrant | None = None
        self._states: dict[tuple[str, str, Any], BranchState] = {}
        self._epochs = itertools.count(1)  # conditioning epochs, unique over the handle's life

    # ------------------------------------------------------------------ lifecycle
    def begin_request(self, request_id: str) -> None:
        self.cache.drop_request(request_id)
        self._drop_states(request_id)

    def _drop_states(self, request_id: str) -> None:
        with self._lock:
            for key in [k for k in self._states if k[0] == request_id]:
                del self._states[key]

    def end_request(self, request_id: str) -> None:
        self.fold_counts()
        dropped = self.cache.drop_request(request_id)
        self._drop_states(request_id)
        self.ledger.note("kv_cache_entries_dropped", dropped, request_id=request_id)
        self.ledger.finish(request_id)

    def release(self) -> None:
        self.fold_counts()
        self._fast = None
        self.cache.clear()
        self._states.clear()
        self._versions.clear()
        for packed in self.groups.values():
            if packed.pack is not None:
                packed.pack.release()
            packed.projection.clear()
        self.groups = {}
        self._order = []
        self._watch = None

    def graph_call(self) -> Any:
        """Beside a CUDA-graph capture of the model's forward: see :mod:`.graph_state`."""
        from worldfoundry_wan_cross_kv_fusion.graph_state import graph_call

        return graph_call(self, _get_ident())

    def fold_counts(self) -> None:
        """Move the hit counters of the validated forwards into the ledger (cheap; safe to call any time)."""
        with self._lock:
            states = list(self._states.values())
        for state in states:
            total = 0
            for packed in self._order:
                i = packed.index
                lead, follow, norm = state.hits[i], state.follows[i], state.norm_hits[i]
                if not lead and not follow and not norm:
                    continue
                state.hits[i] = state.follows[i] = state.norm_hits[i] = 0
                kind = f"cached_{packed.kind}"
                if norm and packed.norm_path is not None:
                    self.ledger.executed(packed.norm_path, f"cached_{packed.kind}_norm", norm,
                                         request_id=state.request_id)
                if lead:
                    self.ledger.executed(packed.paths[0], kind, lead, request_id=state.request_id)
                if follow:
                    for path in packed.paths[1:]:
                        self.ledger.executed(path, kind, follow, request_id=state.request_id)
                total += lead
            if total:
                self.ledger.count("kv_cache_hit", total, request_id=state.request_id)
                self.ledger.count(f"kv_cache_hit.{state.branch}", total, request_id=state.request_id)

    def execution_report(self) -> dict[str, Any]:
        self.fold_counts()
        report = super().execution_report()
        report["packed_groups"] = {
            key: {"paths": list(g.paths), "derived_bytes": g.pack.nbytes if g.pack is not None else 0,
                  "builds": g.pack.builds if g.pack is not None else 0,
                  "bitwise_checks": g.projection.verdicts()}
            for key, g in self.groups.items()
        }
        report["derived_weight_bytes"] = sum(g.pack.nbytes for g in self.groups.values() if g.pack is not None)
        report["kv_cache"] = {"entries": self.cache.entries(), "bytes": self.cache.nbytes(),
                              "evicted_requests": self.cache.evicted_requests}
        report["options"] = self.opts.to_json()
        return report

    # ------------------------------------------------------------------ the forward of the model
    def enter_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook on the model: read the conditioning and, if this forward runs alone, open the fast path."""
        depth = getattr(self._local, "depth", 0)
        with self._lock:
            self._active += 1
            sole = self._active == 1 and depth == 0
            if not sole:
                self._fast = None  # a concurrent (or nested) forward: every call computes on its own
        self._local.depth = depth + 1
        text, image = wan_conditioning_inputs(self._positions, args, kwargs)
        key: tuple[Any, ...] | None = None
        if text is not None:
            key = (
                tensor_state(text, self._versions.version(text)),
                tensor_state(image, self._versions.version(image)) if image is not None else (),
                parameters_state(self._conditioning_modules),
            )
        ctx = current_request()
        if not sole or key is None or ctx is None or self._watch is None:
            return
        state = self._branch_state(ctx)
        if state.conditioning != key:
            state.conditioning = key
            state.epoch = next(self._epochs)
        fast = ForwardGrant(_get_ident(), state, self.cache.request_entries(ctx.request_id), self._watch.generations())
        with self._lock:
            if self._active == 1:
                self._fast = fast

    def exit_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Always-called forward hook on the model: close this thread's fast path and forget the forward."""
        depth = getattr(self._local, "depth", 0)
        if depth <= 0:
            return  # the pre-hook did not run in this thread
        self._local.depth = depth - 1
        with self._lock:
            self._active -= 1
            fast = self._fast
            if fast is not None and fast.owner == _get_ident():
                self._fast = None

    def release_thread(self) -> None:
        """Forget forwards this thread entered but never left (a ``KeyboardInterrupt`` skips the always-called
        hook); otherwise every later forward would look concurrent and never use the static cache."""
        depth = getattr(self._local, "depth", 0)
        if depth <= 0:
            return
        self._local.depth = 0
        with self._lock:
            self._active -= depth
            fast = self._fast
            if fast is not None and fast.owner == _get_ident():
                self._fast = None

    def _branch_state(self, ctx: RequestContext) -> BranchState:
        branch = ctx.branch or "none"
        key = (ctx.request_id, branch, ctx.expert)
        state = self._states.get(key)
        if state is None:
            n = len(self._order)
            slots: list[Hashable] = [(branch, ctx.expert, p.key) for p in self._order]
            state = BranchState(ctx.request_id, branch, slots, [0] * n, [0] * n, [0] * n)
            with self._lock:
                self._states[key] = state
        return state

    # ------------------------------------------------------------------ projections
    def add_group(self, recorder: PatchRecorder, group: ProjectionGroup, norm: nn.Module | None = None,
                  norm_path: str | None = None) -> PackedGroup:
        """Wrap the group's projections (lead: computes or serves the pair; follower: takes its part) and, when
        given, the key normalisation that follows them (served from the cache for a cached key)."""
        modules = group.modules()
        if self.opts.pack:
            pack: DerivedPackedLinear | None = DerivedPackedLinear(modules)
            projection = SharedInputProjection(pack.split_sizes, pack.current)
        else:
            pack = None
            projection = SharedInputProjection([m.out_features for m in modules], lambda: PACK_DISABLED)
        packed = PackedGroup(len(self._order), group, pack, projection, group.paths(),
                             norm_path if norm is not None else None)
        self.groups[packed.key] = packed
        self._order.append(packed)
        self._watched.append((*modules, norm) if norm is not None else modules)
        self._watch = LinearSourceWatch(self._watched)
        if norm is not None:
            recorder.wrap_forward(norm, lambda original: self._key_norm(packed.index, original), name=PLUGIN_NAME)
        originals: list[Callable[..., Any]] = [modules[0].forward]
        for index in range(1, len(modules)):
            originals.append(modules[index].forward)
            recorder.wrap_forward(modules[index], lambda original, i=index: self._follower(packed, i, original),
                                  name=PLUGIN_NAME)

        def make_lead(original: Callable[..., Any]) -> Callable[..., Any]:
            members = [original, *originals[1:]]
            index = packed.index

            def forward(input: Any) -> Any:
                # The common call inside a validated forward of a request: one dict lookup, three comparisons.
                fast = self._fast
                if fast is not None and fast.owner == _get_ident():
                    state = fast.state
                    entry = fast.entries.get(state.slots[index])
                    if (entry is not None and entry.validity == (state.epoch, fast.gens[index], input.shape)
                            and entry.untouched()):
                        state.hits[index] += 1
                        tensors = entry.tensors
                        fast.handoff = (index, input, tensors[1])
                        fast.norm_handoff = (tensors[0], tensors[2]) if len(tensors) == 3 else None
                        return tensors[0]
                    return self._fast_miss(fast, packed, input, members, entry)
                return self._lead(packed, input, members)

            return forward

        recorder.wrap_forward(modules[0], make_lead, name=PLUGIN_NAME)
        return packed

    def _follower(self, packed: PackedGroup, index: int, original: Callable[..., Any]) -> Callable[..., Any]:
        slow = packed.projection.follower_forward(index, original, lambda i, res: self._record(packed, i, res))
        group_index = packed.index

        def forward(input: Any) -> Any:
            fast = self._fast
            if fast is not None and fast.owner == _get_ident():
                handoff = fast.handoff
                if handoff is not None and handoff[0] == group_index and handoff[1] is input:
                    fast.handoff = None
                    fast.state.follows[group_index] += 1
                    return handoff[2]
            return slow(input)

        return forward

    def _key_norm(self, index: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(input: Any) -> Any:
            fast = self._fast
            if fast is not None and fast.owner == _get_ident():
                handoff = fast.norm_handoff
                if handoff is not None and handoff[0] is input:
                    fast.norm_handoff = None
                    fast.state.norm_hits[index] += 1
                    return handoff[1]
                pending = fast.norm_pending
                if pending is not None and pending[0] == index and pending[1] is input:
                    fast.norm_pending = None
                    output = original(input)
                    slot = fast.state.slots[index]
                    entry = fast.entries.get(slot)
                    if entry is not None and len(entry.tensors) == 2 and entry.tensors[0] is input:
                        fast.entries[slot] = CacheEntry.of(entry.validity, (*entry.tensors, output))
                    packed = self._order[index]
                    self.ledger.executed(packed.norm_path, f"computed_{packed.kind}_norm")
                    return output
            return original(input)

        return forward

    def _fast_miss(self, fast: ForwardGrant, packed: PackedGroup, x: torch.Tensor, members: Sequence[Callable[..., Any]],
                   stale: CacheEntry | None) -> torch.Tensor:
        """Inside a validated forward: compute the pair and cache it (or bypass below ``min_tokens``)."""
        fast.handoff = fast.norm_handoff = fast.norm_pending = None
        if _tokens(x) < self.opts.min_tokens:
            return self._bypass(packed, x, members)
        state = fast.state
        rid = state.request_id
        status = "miss" if stale is None else "invalidated"
        self.ledger.count(f"kv_cache_{status}", request_id=rid)
        self.ledger.count(f"kv_cache_miss.{state.branch}", request_id=rid)
        if stale is not None:
            self.ledger.count("kv_cache_miss", request_id=rid)
        result = packed.projection.compute(x, members)
        outputs = tuple(t if t.is_contiguous() else t.contiguous() for t in result.outputs)
        fast.entries[state.slots[packed.index]] = CacheEntry.of(
            (state.epoch, fast.gens[packed.index], x.shape), outputs)
        result = ProjectionResult(outputs, result.fused, result.reason, result.verified)
        if packed.norm_path is not None:
            fast.norm_pending = (packed.index, outputs[0])
        packed.projection.offer(x, result)
        self._record(packed, 0, result)
        return outputs[0]

    def _lead(self, packed: PackedGroup, x: torch.Tensor, members: Sequence[Callable[..., Any]]) -> torch.Tensor:
        """Outside a validated forward of a request: compute without the cache (or bypass below ``min_tokens``)."""
        if _tokens(x) < self.opts.min_tokens:
            return self._bypass(packed, x, members)
        self.ledger.count("kv_cache_unscoped" if current_request() is None else "kv_cache_concurrent")
        result = packed.projection.compute(x, members)
        packed.projection.offer(x, result)
        self._record(packed, 0, result)
        return result.outputs[0]

    def _bypass(self, packed: PackedGroup, x: torch.Tensor, members: Sequence[Callable[..., Any]]) -> torch.Tensor:
        result = ProjectionResult(tuple(m(x) for m in members), False, BELOW_MIN_TOKENS)
        self.ledger.count("dense_bypass")
        packed.projection.offer(x, result)
        self._record(packed, 0, result)
        return result.outputs[0]

    def _record(self, packed: PackedGroup, index: int, result: ProjectionResult | None) -> None:
        path = packed.paths[index]
        if result is None:
            self.ledger.fallback(path, "unpaired_call")
            return
        if result.cached:
            self.ledger.executed(path, f"cached_{packed.kind}")
        elif result.fused:
            self.ledger.executed(path, f"packed_{packed.kind}")
        elif result.reason == PACK_DISABLED:
            self.ledger.executed(path, f"separate_{packed.kind}")
        else:
            self.ledger.fallback(path, result.reason or "dense")
        if index == 0 and result.verified:
            self.ledger.count("bitwise_checks")
            if not result.fused:
                self.ledger.count("bitwise_mismatches")


def _tokens(x: torch.Tensor) -> int:
    return x.shape[-2] if x.dim() >= 2 else 1


__all__ = ["BELOW_MIN_TOKENS", "GROUP_KINDS", "KEY_NORMS", "PACK_DISABLED", "PackedGroup", "WanCrossKVHandle"]
