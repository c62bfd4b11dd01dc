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

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from worldfoundry.core.acceleration.context import NO_REQUEST, current_request_id

DEFAULT_MAX_REQUESTS = 16
DEFAULT_MAX_TRACE = 256
DEFAULT_MAX_MODULES = 4096
#: Most distinct counter names, fallback reasons, notes and traces kept per request; the rest fold into
#: ``OVERFLOW_KEY`` (counters, reasons) or are dropped (notes, traces).
DEFAULT_MAX_KEYS = 256
#: Longest fallback reason kept (longer ones are cut).
MAX_REASON_CHARS = 200
OVERFLOW_KEY = "<other>"


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
    #: the options each expert's factory received, when ``per_expert`` overrides made them differ (else empty).
    per_expert_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "options": jsonable(self.options),
            "claims": list(self.claims),
            "distribution": self.distribution,
            "version": self.version,
            "exact": self.exact,
            "experts": list(self.experts),
            "notes": list(self.notes),
        }
        if self.per_expert_options:
            out["per_expert_options"] = {k: jsonable(v) for k, v in self.per_expert_options.items()}
        return out


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


def jsonable(value: Any) -> Any:
    """A JSON-serialisable copy of ``value``: mappings and sequences recursively, one-element tensors as their
    value, larger tensors as a short description (never their data), anything else as ``str``."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [jsonable(v) for v in items]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if hasattr(value, "numel") and hasattr(value, "dtype") and hasattr(value, "shape"):
        if value.numel() == 1:
            return jsonable(value.item())
        return f"<tensor shape={list(value.shape)} dtype={value.dtype}>"
    return str(value)


_jsonable = jsonable


def _bounded_add(counts: dict[str, int], key: str, n: int, limit: int) -> None:
    """``counts[key] += n``, folding new keys into ``OVERFLOW_KEY`` once ``limit`` distinct keys exist."""
    if key not in counts and len(counts) >= limit:
        key = OVERFLOW_KEY
    counts[key] = counts.get(key, 0) + n


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
            "notes": dict(self.notes),
            "traces": {k: list(v) for k, v in self.traces.items()},
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
        self._diverted: list[LedgerCall] | None = None
        self._diverted_thread: int | None = None

    # ------------------------------------------------------------------ diverting (CUDA-graph capture)
    @contextlib.contextmanager
    def divert(self) -> Iterator[list[LedgerCall]]:
        """Record this thread's calls into a list instead of applying them, inside the block.

        Used while a forward is captured into a CUDA graph: the Python of the captured forward runs once but its
        kernels run on every replay, so the calls are kept and applied (:meth:`apply`) once per replay.

        Yields:
            The list the calls are appended to, as ``(method, args, kwargs)``.

        Raises:
            RuntimeError: the ledger is already diverted.
        """
        calls: list[LedgerCall] = []
        with self._lock:
            if self._diverted is not None:
                raise RuntimeError(f"the ledger of {self.plugin} is already diverted")
            self._diverted, self._diverted_thread = calls, threading.get_ident()
        try:
            yield calls
        finally:
            with self._lock:
                self._diverted = self._diverted_thread = None

    def _divert(self, method: str, args: tuple[Any, ...], request_id: str | None) -> bool:
        """Keep the call if this thread diverts the ledger (``True``: the caller must not apply it)."""
        if self._diverted_thread != threading.get_ident():
            return False
        calls = self._diverted
        if calls is None:
            return False
        calls.append((method, args, {"request_id": request_id}))
        return True

    def apply(self, calls: Iterable[LedgerCall], *, request_id: str | None = None,
              replace_request: str | None = None) -> None:
        """Apply calls kept by :meth:`divert`.

        Args:
            calls: ``(method, args, kwargs)`` as kept.
            request_id: the request to record them for (``None``: the current one).
            replace_request: calls that named this request id explicitly (or none) are recorded for
                ``request_id``; calls naming another id keep it.
        """
        for method, args, kwargs in calls:
            if method not in _RECORDING_METHODS:
                continue
            rid = kwargs.get("request_id")
            if rid is None or rid == replace_request:
                rid = request_id
            getattr(self, method)(*args, request_id=rid)

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
        _bounded_add(rec.counters, counter, n, DEFAULT_MAX_KEYS)
        _bounded_add(self._totals, counter, n, DEFAULT_MAX_KEYS)

    # ------------------------------------------------------------------ recording
    def executed(self, module: str, kind: str = "kernel", n: int = 1, *, request_id: str | None = None) -> None:
        if self._diverted is not None and self._divert("executed", (module, kind, n), request_id):
            return
        with self._lock:
            rec = self._record(request_id)
            self._bump(rec, kind, n)
            if module in rec.modules or len(rec.modules) < DEFAULT_MAX_MODULES:
                per = rec.modules.setdefault(module, {})
                per[kind] = per.get(kind, 0) + n

    def fallback(self, module: str, reason: str, n: int = 1, *, request_id: str | None = None) -> None:
        if self._diverted is not None and self._divert("fallback", (module, reason, n), request_id):
            return
        with self._lock:
            rec = self._record(request_id)
            reason = str(reason)[:MAX_REASON_CHARS]
            self._bump(rec, "dense_fallback", n)
            _bounded_add(rec.fallbacks, reason, n, DEFAULT_MAX_KEYS)
            if module in rec.module_fallbacks or len(rec.module_fallbacks) < DEFAULT_MAX_MODULES:
                per = rec.module_fallbacks.setdefault(module, {})
                _bounded_add(per, reason, n, DEFAULT_MAX_KEYS)

    def skipped(self, what: str, n: int = 1, *, request_id: str | None = None) -> None:
        if self._diverted is not None and self._divert("skipped", (what, n), request_id):
            return
        with self._lock:
            rec = self._record(request_id)
            _bounded_add(rec.skipped, what, n, DEFAULT_MAX_KEYS)
            self._bump(rec, f"skipped_{what}", n)

    def count(self, counter: str, n: int = 1, *, request_id: str | None = None) -> None:
        if self._diverted is not None and self._divert("count", (counter, n), request_id):
            return
        with self._lock:
            self._bump(self._record(request_id), counter, n)

    def note(self, key: str, value: Any, *, request_id: str | None = None) -> None:
        """Keep one small value (stored JSON-serialisable; tensors are never kept)."""
        if self._diverted is not None and self._divert("note", (key, value), request_id):
            return
        with self._lock:
            notes = self._record(request_id).notes
            if key in notes or len(notes) < DEFAULT_MAX_KEYS:
                notes[key] = jsonable(value)

    def trace(self, key: str, value: Any, *, request_id: str | None = None) -> None:
        """Append to a capped list (``max_trace`` values per key)."""
        if self._diverted is not None and self._divert("trace", (key, value), request_id):
            return
        with self._lock:
            traces = self._record(request_id).traces
            if key not in traces and len(traces) >= DEFAULT_MAX_KEYS:
                return
            values = traces.setdefault(key, [])
            if len(values) < self.max_trace:
                values.append(jsonable(value))

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


#: One kept ledger call: ``(method name, positional args, {"request_id": ...})``.
LedgerCall = tuple[str, tuple[Any, ...], dict[str, Any]]
_RECORDING_METHODS = frozenset({"executed", "fallback", "skipped", "count", "note", "trace"})


def empty_request_report() -> dict[str, Any]:
    return _RequestRecord().to_json()


__all__ = [
    "NO_REQUEST",
    "ExecutionLedger",
    "InstallReceipt",
    "LedgerCall",
    "PluginInstallRecord",
    "empty_request_report",
    "jsonable",
]
