"""``wan_cross_kv_fusion`` beside a CUDA-graph capture of the model's forward.

Inside a validated forward of a request the cached K/V (and normalised K) of the current (request, CFG branch,
expert) are served from the cache without any GPU work, so a captured graph of that *hit path* reads the cached
tensors' addresses. For one graph to serve every request and branch, :func:`graph_call` hands the graph runner
the current branch's cached tensors (copied into graph-owned buffers before every replay) and a ``serve`` context
that, while the forward is captured, puts those buffers in the cache entries' place (and takes back the hit counts
the capture made); every replay then counts the same hits for the branch that replays. A call whose entries are not
cached yet (the first step of a branch, or after a conditioning or weight change) runs eagerly; calls outside a
request or beside a concurrent forward compute without the cache, which a graph captures as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from worldfoundry.core.acceleration.context import current_request
from worldfoundry.core.acceleration.cuda_graph.participants import GraphCall
from worldfoundry.core.attention.static_kv_cache import CacheEntry

if TYPE_CHECKING:
    from worldfoundry_wan_cross_kv_fusion.handle import WanCrossKVHandle
    from worldfoundry_wan_cross_kv_fusion.runtime_state import BranchState, ForwardGrant

NOT_CACHED = "static K/V not cached for this branch yet (first call, or the conditioning or weights changed)"


def graph_call(handle: WanCrossKVHandle, owner: int) -> GraphCall:
    """The graph runner's view of the call being made on ``handle``'s model in thread ``owner``."""
    fast = handle._fast
    if fast is None or fast.owner != owner:
        return GraphCall(key=("uncached", current_request() is None))
    state = fast.state
    tensors: list[torch.Tensor] = []
    shapes: list[Any] = []
    for packed in handle._order:
        i = packed.index
        entry = fast.entries.get(state.slots[i])
        if entry is None or entry.validity[:2] != (state.epoch, fast.gens[i]) or not entry.untouched():
            return GraphCall(eager_reason=NOT_CACHED)
        tensors.extend(entry.tensors)
        shapes.append((entry.validity[2], tuple(tuple(t.shape) for t in entry.tensors)))
    return GraphCall(key=("hit", tuple(shapes)), tensors=tuple(tensors),
                     serve=lambda buffers: _serve(handle, fast, buffers),
                     replayed=lambda taken: _count(state, taken))


@contextlib.contextmanager
def _serve(handle: WanCrossKVHandle, fast: ForwardGrant, buffers: Sequence[torch.Tensor]
           ) -> Iterator[list[tuple[int, int, int]]]:
    """Serve ``buffers`` in place of the branch's cached tensors; yield the hits the block counted (taken back)."""
    state = fast.state
    saved = {}
    offset = 0
    for packed in handle._order:
        slot = state.slots[packed.index]
        entry = fast.entries[slot]
        n = len(entry.tensors)
        saved[slot] = entry
        fast.entries[slot] = CacheEntry.of(entry.validity, tuple(buffers[offset:offset + n]))
        offset += n
    before = (list(state.hits), list(state.follows), list(state.norm_hits))
    taken: list[tuple[int, int, int]] = []
    try:
        yield taken
    finally:
        fast.entries.update(saved)
        fast.handoff = fast.norm_handoff = fast.norm_pending = None
        taken.extend((h - h0, f - f0, m - m0) for h, h0, f, f0, m, m0 in zip(
            state.hits, before[0], state.follows, before[1], state.norm_hits, before[2], strict=True))
        state.hits[:], state.follows[:], state.norm_hits[:] = before


def _count(state: BranchState, taken: Sequence[tuple[int, int, int]]) -> None:
    """Count one execution of the captured hit path for ``state``'s branch."""
    for i, (hits, follows, norms) in enumerate(taken):
        state.hits[i] += hits
        state.follows[i] += follows
        state.norm_hits[i] += norms


__all__ = ["NOT_CACHED", "graph_call"]
