"""Per-request cache of projections of a conditioning that stays constant over the denoising steps.

Cross-attention keys and values of the text (and image) conditioning depend only on the conditioning and the
projection weights, not on the step, so they can be computed once per (request, CFG branch, expert, module) and
reused. :class:`StaticKVCache` stores them with the *validity key* they were computed under (identity, version,
pointer and layout of the conditioning tensors and weights; see :mod:`.fingerprints`) and serves them only while
that key is unchanged and the cached tensors themselves were not modified in place. Entries of a request are
dropped when the request ends; at most ``max_requests`` requests are kept (oldest evicted first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from worldfoundry.core.attention.fingerprints import tensor_version

HIT = "hit"
MISS = "miss"
INVALIDATED = "invalidated"


@dataclass
class CacheEntry:
    """Cached tensors, the validity key they were computed under and their version counters when stored."""

    validity: tuple[Any, ...]
    tensors: tuple[torch.Tensor, ...]
    versions: tuple[int | None, ...]

    @classmethod
    def of(cls, validity: tuple[Any, ...], tensors: tuple[torch.Tensor, ...]) -> CacheEntry:
        return cls(validity, tuple(tensors), tuple(tensor_version(t) for t in tensors))

    def untouched(self) -> bool:
        """Whether no cached tensor was modified in place since it was stored (inference tensors: assumed)."""
        return tuple(tensor_version(t) for t in self.tensors) == self.versions


class StaticKVCache:
    """Request-scoped store of tensors keyed by ``(request_id, slot)`` and guarded by a validity key.

    Thread-safe. Never holds tensors of more than ``max_requests`` requests.
    """

    def __init__(self, max_requests: int = 8) -> None:
        if max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        self.max_requests = max_requests
        self._lock = threading.Lock()
        self._requests: OrderedDict[str, dict[Hashable, CacheEntry]] = OrderedDict()
        self.evicted_requests = 0

    def lookup(self, request_id: str, slot: Hashable,
               validity: tuple[Any, ...]) -> tuple[tuple[torch.Tensor, ...] | None, str]:
        """The cached tensors of ``slot`` if still valid.

        Args:
            request_id: the running request.
            slot: what the tensors are (e.g. ``(branch, expert, module path, "text")``).
            validity: the key the tensors must have been computed under.

        Returns:
            ``(tensors, "hit")``, ``(None, "miss")`` (nothing cached) or ``(None, "invalidated")`` (an entry existed
            but its key differs or its tensors were modified in place; it is dropped).
        """
        with self._lock:
            entries = self._requests.get(request_id)
            entry = entries.get(slot) if entries is not None else None
            if entry is None:
                return None, MISS
            if entry.validity == validity and entry.untouched():
                self._requests.move_to_end(request_id)
                return entry.tensors, HIT
            del entries[slot]
            return None, INVALIDATED

    def store(self, request_id: str, slot: Hashable, validity: tuple[Any, ...],
              tensors: tuple[torch.Tensor, ...]) -> None:
        """Remember ``tensors`` for ``slot`` of ``request_id`` under ``validity``."""
        with self._lock:
            self._entries_locked(request_id)[slot] = CacheEntry.of(validity, tuple(tensors))

    def request_entries(self, request_id: str) -> dict[Hashable, CacheEntry]:
        """The live ``slot -> entry`` dict of ``request_id`` (created, and marked most recent).

        For a caller that looks entries up many times per model forward without taking the lock: it reads and
        writes the dict directly (single dict operations are atomic) and checks :attr:`CacheEntry.validity` and
        :meth:`CacheEntry.untouched` itself. :meth:`drop_request`, eviction and :meth:`clear` detach the dict from
        the cache; entries written to a detached dict are simply forgotten.
        """
        with self._lock:
            return self._entries_locked(request_id)

    def _entries_locked(self, request_id: str) -> dict[Hashable, CacheEntry]:
        entries = self._requests.get(request_id)
        if entries is None:
            entries = self._requests[request_id] = {}
        self._requests.move_to_end(request_id)
        while len(self._requests) > self.max_requests:
            self._requests.popitem(last=False)
            self.evicted_requests += 1
        return entries

    def drop_request(self, request_id: str) -> int:
        """Forget every entry of ``request_id``. Returns how many were dropped."""
        with self._lock:
            entries = self._requests.pop(request_id, None)
            return len(entries) if entries else 0

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()

    def entries(self, request_id: str | None = None) -> int:
        """Number of cached slots (of one request, or of all)."""
        with self._lock:
            if request_id is not None:
                return len(self._requests.get(request_id, {}))
            return sum(len(e) for e in self._requests.values())

    def nbytes(self) -> int:
        """Bytes held by cached tensors (storages counted once)."""
        seen: dict[int, int] = {}
        with self._lock:
            for entries in self._requests.values():
                for entry in entries.values():
                    for t in entry.tensors:
                        storage = t.untyped_storage()
                        seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


__all__ = ["HIT", "INVALIDATED", "MISS", "CacheEntry", "StaticKVCache"]
