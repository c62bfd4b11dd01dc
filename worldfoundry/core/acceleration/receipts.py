"""Receipts are data: what was installed (install receipt) and what actually ran (execution ledger).

Both are bounded in size and JSON-serialisable; no tensors are ever kept.

Execution ledger vocabulary (the benchmark's execution proof reads it):

* ``ledger.executed(module, kind)`` — the accelerated path ran on ``module`` (``kind`` e.g. ``"kernel"``,
  ``"fused"``, ``"cache_hit"``).
* ``ledger.fallback(module, reason)`` — the dense/original path ran instead, with the reason.
* ``ledger.skipped(what, n)`` — work skipped (``"steps"``, ``"blocks"``) by a cache.
* ``ledger.note(key, value)`` / ``ledger.trace(key, value)`` — small values / capped lists.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from worldfoundry.core.acceleration.context import NO_REQUEST, current_request_id

DEFAULT_MAX_REQUESTS = 16
DEFAULT_MAX_TRACE = 256
DEFAULT_MAX_MODULES = 4096


@dataclass(frozen=True)
class PluginInstallRecord:
    name: str
    options: Mapping[str, Any]
    claims: tuple[str, ...]
    distribution: str | None
    version: str | None
    exact: bool | None
    experts: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "options": _jsonable(self.options),
            "claims": list(self.claims),
            "distribution": self.distribution,
            "version": self.version,
            "exact": self.exact,
            "experts": list(self.experts),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class InstallReceipt:
    """What an install did. ``execution_verified`` is always ``False``: installing proves nothing ran."""

    plugins: tuple[PluginInstallRecord, ...]
    model_class: str
    experts: tuple[str, ...]
    installed_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    execution_verified: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.plugins)

    @property
    def exact(self) -> bool:
        """True when every installed plugin claims bitwise exactness."""
        return all(p.exact is True for p in self.plugins)

    def to_json(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "plugins": [p.to_json() for p in self.plugins],
            "model_class": self.model_class,
            "experts": list(self.experts),
            "installed_at": self.installed_at,
            "exact": self.exact,
            "execution_verified": False,
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return str(value)


class _RequestRecord:
    __slots__ = ("counters", "modules", "fallbacks", "module_fallbacks", "skipped", "notes", "traces", "finished")

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.modules: dict[str, dict[str, int]] = {}
        self.fallbacks: dict[str, int] = {}
        self.module_fallbacks: dict[str, dict[str, int]] = {}
        self.skipped: dict[str, int] = {}
        self.notes: dict[str, Any] = {}
        self.traces: dict[str, list[Any]] = {}
        self.finished = False

    def to_json(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters),
            "modules": {k: dict(v) for k, v in self.modules.items()},
            "fallbacks": dict(self.fallbacks),
            "module_fallbacks": {k: dict(v) for k, v in self.module_fallbacks.items()},
            "skipped": dict(self.skipped),
            "notes": _jsonable(self.notes),
            "traces": _jsonable(self.traces),
            "finished": self.finished,
        }


class ExecutionLedger:
    """Per-request execution counters of one plugin on one model (thread-safe, bounded).

    Requests are keyed by the current :class:`~worldfoundry.core.acceleration.context.RequestContext`'s id
    (``"<no-request>"`` outside one). Only the last ``max_requests`` requests are kept; totals cover all.
    """

    def __init__(self, plugin: str, *, max_requests: int = DEFAULT_MAX_REQUESTS,
                 max_trace: int = DEFAULT_MAX_TRACE) -> None:
        self.plugin = plugin
        self.max_requests = max_requests
        self.max_trace = max_trace
        self._lock = threading.Lock()
        self._requests: OrderedDict[str, _RequestRecord] = OrderedDict()
        self._totals: dict[str, int] = {}
        self._dropped_requests = 0

    def _record(self, request_id: str | None) -> _RequestRecord:
        rid = request_id or current_request_id()
        rec = self._requests.get(rid)
        if rec is None:
            rec = _RequestRecord()
            self._requests[rid] = rec
            while len(self._requests) > self.max_requests:
                self._requests.popitem(last=False)
                self._dropped_requests += 1
        return rec

    def _bump(self, rec: _RequestRecord, counter: str, n: int) -> None:
        rec.counters[counter] = rec.counters.get(counter, 0) + n
        self._totals[counter] = self._totals.get(counter, 0) + n

    # ------------------------------------------------------------------ recording
    def executed(self, module: str, kind: str = "kernel", n: int = 1, *, request_id: str | None = None) -> None:
        with self._lock:
            rec = self._record(request_id)
            self._bump(rec, kind, n)
            if module in rec.modules or len(rec.modules) < DEFAULT_MAX_MODULES:
                per = rec.modules.setdefault(module, {})
                per[kind] = per.get(kind, 0) + n

    def fallback(self, module: str, reason: str, n: int = 1, *, request_id: str | None = None) -> None:
        with self._lock:
            rec = self._record(request_id)
            self._bump(rec, "dense_fallback", n)
            rec.fallbacks[reason] = rec.fallbacks.get(reason, 0) + n
            if module in rec.module_fallbacks or len(rec.module_fallbacks) < DEFAULT_MAX_MODULES:
                per = rec.module_fallbacks.setdefault(module, {})
                per[reason] = per.get(reason, 0) + n

    def skipped(self, what: str, n: int = 1, *, request_id: str | None = None) -> None:
        with self._lock:
            rec = self._record(request_id)
            rec.skipped[what] = rec.skipped.get(what, 0) + n
            self._bump(rec, f"skipped_{what}", n)

    def count(self, counter: str, n: int = 1, *, request_id: str | None = None) -> None:
        with self._lock:
            self._bump(self._record(request_id), counter, n)

    def note(self, key: str, value: Any, *, request_id: str | None = None) -> None:
        with self._lock:
            self._record(request_id).notes[key] = value

    def trace(self, key: str, value: Any, *, request_id: str | None = None) -> None:
        with self._lock:
            values = self._record(request_id).traces.setdefault(key, [])
            if len(values) < self.max_trace:
                values.append(value)

    def finish(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._requests:
                self._requests[request_id].finished = True

    # ------------------------------------------------------------------ reading
    def request_report(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            rec = self._requests.get(request_id)
            return rec.to_json() if rec is not None else None

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {
                "plugin": self.plugin,
                "totals": dict(self._totals),
                "requests": {rid: rec.to_json() for rid, rec in self._requests.items()},
                "dropped_requests": self._dropped_requests,
                "max_requests": self.max_requests,
            }


def empty_request_report() -> dict[str, Any]:
    return _RequestRecord().to_json()


__all__ = [
    "NO_REQUEST",
    "ExecutionLedger",
    "InstallReceipt",
    "PluginInstallRecord",
    "empty_request_report",
]
