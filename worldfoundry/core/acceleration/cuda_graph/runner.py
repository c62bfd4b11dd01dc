"""``GraphRunner``: replay a model's forward from captured graphs, one per call signature, or run it eagerly.

Per model call (the wrapped ``forward``): check that capture is possible (backend, autograd off, no outer capture,
no other forward running on the model, every co-installed plugin composes), bump the generation when anything the
graphs depend on changed (then every graph is dropped), ask the co-installed plugins about this call, key it
(:func:`~.signature.call_signature` plus the installed plugin set and the plugins' keys), then:

* a captured signature: copy the inputs (and the plugins' per-call tensors) into its static buffers, replay,
  apply the plugins' kept ledger calls for this request, and return a copy of the static outputs (or, with
  ``output="static"``, the static outputs themselves: valid until the next call of that signature);
* a new signature: warm up (an eager forward on the static buffers, whose output this call returns), capture
  into a private pool, and keep it, evicting the least recently used signature beyond ``max_signatures``;
* anything else: the eager forward, recorded with its reason.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from worldfoundry.core.acceleration.context import current_request_id
from worldfoundry.core.acceleration.cuda_graph.backends import CapturedForward, GraphBackend
from worldfoundry.core.acceleration.cuda_graph.participants import GraphCall, Participant, Participants, gather
from worldfoundry.core.acceleration.cuda_graph.signature import (
    CallSignature,
    StaticArguments,
    TensorSpec,
    UnkeyableArgument,
    allocate_like,
    call_signature,
    load_into,
)
from worldfoundry.core.acceleration.cuda_graph.watch import ModelStateWatch
from worldfoundry.core.acceleration.prepared import ROOT_MODULE
from worldfoundry.core.acceleration.receipts import ExecutionLedger, LedgerCall
from worldfoundry.core.acceleration.session import get_session

logger = logging.getLogger(__name__)

MAX_FAILED = 64
MAX_REASON = 160


@dataclass
class CapturedSignature:
    """One captured signature: its buffers, graph, kept ledger calls and counters."""

    description: str
    static: StaticArguments
    part_buffers: tuple[torch.Tensor, ...]
    captured: CapturedForward
    kept: list[tuple[ExecutionLedger, list[LedgerCall]]]
    capture_request: str
    capture_seconds: float
    #: ``{"calls": [...]}``: the plugin calls of the call being made (what the forward serves from on a re-run)
    holder: dict[str, Any] = field(default_factory=dict)
    #: what each plugin's ``serve`` yielded during the capture (handed to its ``replayed``)
    tokens: list[Any] = field(default_factory=list)
    replays: int = 0

    def report(self) -> dict[str, Any]:
        return {"inputs": self.description, "replays": self.replays, "capture_seconds": round(self.capture_seconds, 4),
                "pool_bytes": self.captured.pool_bytes, "static_input_bytes": self.static.nbytes
                + sum(b.untyped_storage().nbytes() for b in self.part_buffers)}

    def release(self) -> None:
        self.captured.release()
        self.static.release()
        self.part_buffers = ()
        self.kept = []
        self.holder.clear()
        self.tokens = []


class GraphRunner:
    """Captured graphs of one model's forward (see the module docstring).

    Args:
        model: the captured module.
        name: the graph plugin's name (its own entry among the session's plugins).
        ledger: where calls, captures, replays and eager fallbacks are recorded.
        backend: the capture backend.
        max_signatures: captured signatures kept (least recently used evicted).
        output: ``"copy"`` (callers own what they get) or ``"static"`` (the graph's own buffers).
        warmup_calls: eager calls of a new signature before it is captured.
        safe_names: co-installed plugin names that compose without declaring it.
    """

    def __init__(self, model: nn.Module, name: str, ledger: ExecutionLedger, backend: GraphBackend, *,
                 max_signatures: int = 4, output: str = "copy", warmup_calls: int = 0,
                 safe_names: frozenset[str] = frozenset()) -> None:
        self._model = weakref.ref(model)
        self.name = name
        self.ledger = ledger
        self.backend = backend
        self.max_signatures = max_signatures
        self.output = output
        self.warmup_calls = warmup_calls
        self.safe_names = safe_names
        self._busy = threading.Lock()
        self._entries: OrderedDict[Hashable, CapturedSignature] = OrderedDict()
        self._failed: OrderedDict[Hashable, str] = OrderedDict()
        self._seen: OrderedDict[Hashable, int] = OrderedDict()
        self._watch: ModelStateWatch | None = None
        self._generation = 0
        self._device: torch.device | None = None  # cached while the watched tensors do not change
        self._session: Any = None
        self._participants = Participants()
        self.invalidations: deque[str] = deque(maxlen=8)
        self.totals = {"captures": 0, "replays": 0, "eager_calls": 0, "evictions": 0, "invalidations": 0,
                       "capture_failures": 0, "replay_divergences": 0}

    # ------------------------------------------------------------------ the call
    def __call__(self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._busy.acquire(blocking=False):
            return self._eager(original, args, kwargs, "another forward is running on this model")
        try:
            return self._call(original, args, kwargs)
        finally:
            self._busy.release()

    def _call(self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        model = self._model()
        device = self._device if self._device is not None else _device_of(model)
        reason = self.backend.unavailable(device) or _process_refusal(device)
        if reason:
            return self._eager(original, args, kwargs, reason)
        participants = self._current_participants(model)
        if participants.refusal:
            return self._eager(original, args, kwargs, participants.refusal)
        self._check_generation(model)
        device = self._device if self._device is not None else device
        calls, reason = participants.calls()
        if reason:
            return self._eager(original, args, kwargs, reason)
        try:
            signature = call_signature(args, kwargs, extra=(self._session_names(), tuple(c.key for _, c in calls)))
        except UnkeyableArgument as exc:
            return self._eager(original, args, kwargs, str(exc))
        key = signature.key
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return self._replay(entry, signature, calls, participants)
        failure = self._failed.get(key)
        if failure is not None:
            return self._eager(original, args, kwargs, failure)
        seen = self._seen.pop(key, 0)
        if seen < self.warmup_calls:
            _bounded_put(self._seen, key, seen + 1, MAX_FAILED)
            return self._eager(original, args, kwargs, f"warming up ({seen + 1} of {self.warmup_calls} eager calls)")
        return self._capture(original, args, kwargs, signature, calls, participants, device)

    def _eager(self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], reason: str) -> Any:
        self.totals["eager_calls"] += 1
        self.ledger.fallback(ROOT_MODULE, reason)
        return original(*args, **kwargs)

    # ------------------------------------------------------------------ capture
    def _capture(self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 signature: CallSignature, calls: list[tuple[Participant, GraphCall]], participants: Participants,
                 device: torch.device) -> Any:
        start = time.perf_counter()
        while len(self._entries) >= self.max_signatures:
            _, evicted = self._entries.popitem(last=False)
            evicted.release()
            self.totals["evictions"] += 1
            self.ledger.count("evictions")
        static = StaticArguments(args, kwargs, signature, pin=self.backend.pins_host_memory)
        static.load(signature.tensors)
        part_tensors = [t for _, c in calls for t in c.tensors]
        part_buffers = tuple(allocate_like(TensorSpec.of(t, "plugin tensor")) for t in part_tensors)
        load_into(part_buffers, part_tensors)
        holder: dict[str, Any] = {"calls": calls, "tokens": []}
        run = _run_on(original, static, part_buffers, holder)
        participants.fold()
        out = self.backend.warm_up(run, device)  # a real forward; its errors are the caller's
        _replayed(calls, holder["tokens"])
        participants.fold()  # the warm-up's counts are the warm-up's, not part of what every replay repeats
        try:
            with participants.diverted() as kept:
                captured = self.backend.capture(run, device)
                participants.fold()
        except Exception as exc:
            reason = f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            reason = reason[:MAX_REASON]
            logger.warning("%s: %s (%s); this signature runs eagerly", self.name, reason, signature.describe())
            _bounded_put(self._failed, signature.key, reason, MAX_FAILED)
            static.release()
            self.totals["capture_failures"] += 1
            self.ledger.count("capture_failures")
            self.ledger.fallback(ROOT_MODULE, reason)
            return out
        entry = CapturedSignature(signature.describe(), static, part_buffers, captured, _coalesced(kept),
                                  current_request_id(), time.perf_counter() - start, holder, list(holder["tokens"]))
        self._entries[signature.key] = entry
        self.totals["captures"] += 1
        self.ledger.count("captures")
        self.ledger.executed(ROOT_MODULE, "capture")
        self.ledger.note("pool_bytes", self.pool_bytes())
        self.ledger.trace("capture_seconds", round(entry.capture_seconds, 4))
        return out

    # ------------------------------------------------------------------ replay
    def _replay(self, entry: CapturedSignature, signature: CallSignature, calls: list[tuple[Participant, GraphCall]],
                participants: Participants) -> Any:
        entry.static.load(signature.tensors)
        load_into(entry.part_buffers, [t for _, c in calls for t in c.tensors])
        entry.holder["calls"] = calls
        if self.backend.reruns_python:
            participants.fold()  # counts made before this call are not the replay's
            with participants.diverted() as kept:
                entry.captured.replay()
                participants.fold()
            if _comparable(_coalesced(kept)) != _comparable(entry.kept):
                self.totals["replay_divergences"] += 1
                self.ledger.count("replay_divergences")
        else:
            entry.captured.replay()
        for ledger, kept_calls in entry.kept:
            ledger.apply(kept_calls, replace_request=entry.capture_request)
        _replayed(calls, entry.tokens)
        entry.replays += 1
        self.totals["replays"] += 1
        self.ledger.executed(ROOT_MODULE, "replay")
        outputs = entry.captured.outputs
        if self.output == "static":
            return outputs
        leaves, spec = tree_flatten(outputs)
        return tree_unflatten([t.clone() if isinstance(t, torch.Tensor) else t for t in leaves], spec)

    # ------------------------------------------------------------------ state
    def _current_participants(self, model: nn.Module) -> Participants:
        session = get_session(model)
        if session is not self._session:
            self._session = session
            self._participants = gather(session, model, self.name, self.safe_names)
            if self._entries:
                self._invalidate("the installed plugin set changed")
        return self._participants

    def _session_names(self) -> tuple[str, ...]:
        return tuple(self._session.names) if self._session is not None else ()

    def _check_generation(self, model: nn.Module) -> None:
        if self._watch is None:
            self._watch = ModelStateWatch(model)
            self._generation = self._watch.generation
            self._device = _device_of(model)
            return
        generation = self._watch.check()
        if generation != self._generation:
            self._generation = generation
            self._device = _device_of(model)
            self._invalidate(self._watch.last_change)

    def _invalidate(self, reason: str) -> None:
        dropped = len(self._entries)
        self.release_graphs()
        self._failed.clear()
        self.totals["invalidations"] += 1
        self.invalidations.append(reason)
        self.ledger.count("invalidations")
        self.ledger.trace("invalidated", f"{reason} ({dropped} graph(s) dropped)")

    def release_graphs(self) -> None:
        """Free every captured graph, its pool and its buffers."""
        while self._entries:
            _, entry = self._entries.popitem(last=False)
            entry.release()

    def release(self) -> None:
        self.release_graphs()
        self._failed.clear()
        self._seen.clear()
        self._watch = None
        self._device = None
        self._session = None
        self._participants = Participants()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def pool_bytes(self) -> int:
        return sum(e.captured.pool_bytes for e in self._entries.values())

    def report(self) -> dict[str, Any]:
        return {"backend": self.backend.name, "max_signatures": self.max_signatures, "output": self.output,
                "signatures": [e.report() for e in self._entries.values()],
                "failed_signatures": list(self._failed.values()), "pool_bytes": self.pool_bytes(),
                "totals": dict(self.totals), "invalidations": list(self.invalidations),
                "parameter_versions_watched": self._watch.versions_seen if self._watch is not None else None}


def _run_on(original: Callable[..., Any], static: StaticArguments, buffers: tuple[torch.Tensor, ...],
            holder: dict[str, Any]) -> Callable[[], Any]:
    """The forward on the static buffers, with the plugins of the call being made serving their buffers; the
    tokens their ``serve`` contexts yield are left in ``holder["tokens"]``."""

    def run() -> Any:
        tokens: list[Any] = []
        holder["tokens"] = tokens
        with contextlib.ExitStack() as stack:
            offset = 0
            for _, call in holder["calls"]:
                n = len(call.tensors)
                tokens.append(stack.enter_context(call.serve(buffers[offset:offset + n]))
                              if call.serve is not None else None)
                offset += n
            with torch.no_grad():
                return original(*static.args, **static.kwargs)

    return run


def _replayed(calls: list[tuple[Participant, GraphCall]], tokens: list[Any]) -> None:
    for (_, call), token in zip(calls, tokens, strict=True):
        if call.replayed is not None:
            call.replayed(token)


_SUMMED = frozenset({"executed", "fallback", "skipped", "count"})


def _coalesced(kept: list[tuple[ExecutionLedger, list[LedgerCall]]]) -> list[tuple[ExecutionLedger, list[LedgerCall]]]:
    """The kept calls with repeated counting calls summed (``executed("m", "k", 1)`` x 30 -> one call with 30), so
    a replay applies a few calls per plugin instead of one per module call."""
    out = []
    for ledger, calls in kept:
        merged: dict[Any, LedgerCall] = {}
        for method, args, kwargs in calls:
            if method in _SUMMED and args and isinstance(args[-1], int):
                key = (method, args[:-1], kwargs.get("request_id"))
                previous = merged.get(key)
                n = args[-1] + (previous[1][-1] if previous is not None else 0)
                merged[key] = (method, (*args[:-1], n), kwargs)
            else:
                merged[(len(merged), method)] = (method, args, kwargs)
        out.append((ledger, list(merged.values())))
    return out


def _comparable(kept: list[tuple[ExecutionLedger, list[LedgerCall]]]) -> list[Any]:
    def value(v: Any) -> Any:
        return f"<tensor {tuple(v.shape)}>" if isinstance(v, torch.Tensor) else v

    return [(id(ledger), [(m, tuple(value(a) for a in args)) for m, args, _ in calls]) for ledger, calls in kept]


def _device_of(model: nn.Module | None) -> torch.device:
    if model is None:
        return torch.device("cpu")
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def _process_refusal(device: torch.device) -> str:
    if torch.is_grad_enabled():
        return "autograd is enabled; call the model under torch.no_grad() or torch.inference_mode()"
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "an outer CUDA graph capture is running"
    return ""


def _bounded_put(store: OrderedDict[Hashable, Any], key: Hashable, value: Any, limit: int) -> None:
    store[key] = value
    store.move_to_end(key)
    while len(store) > limit:
        store.popitem(last=False)


__all__ = ["CapturedSignature", "GraphRunner"]
