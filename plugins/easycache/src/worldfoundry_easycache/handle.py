"""``EasyCacheHandle``: the wrapped model forward and the request lifecycle of one expert.

Per call (inside the runner's :class:`~worldfoundry.core.acceleration.context.RequestContext`) the wrapper
admits the call (request, branch, step order, schedule), decides between computing and reusing the cached
transformation, and records the decision in the execution ledger: ``executed("<root>", "computed")`` for a
computed step, ``skipped("steps")`` for a reused one (one count per model call, so a skipped CFG step counts
twice). ``end_request`` writes a bounded summary (per-branch counts and decision pattern, outcome) and drops
every tensor of the request; an exception inside a call drops them at once.
"""

from __future__ import annotations

import inspect
import logging
import math
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch
import torch.nn as nn

from worldfoundry.core.acceleration.caching import ConditionSnapshot, dense_gate
from worldfoundry.core.acceleration.schedule import RequestSchedule
from worldfoundry.plugin import (
    ROOT_MODULE,
    ExecutionLedger,
    InvalidRequestError,
    PatchRecorder,
    RecordedHandle,
    RequestError,
    current_request,
    get_session,
)
from worldfoundry_easycache.options import PLUGIN_NAME, Options
from worldfoundry_easycache.refusals import RUNTIME_CONTROL_ARGUMENTS
from worldfoundry_easycache.request_state import Admission, BranchRecord, RequestState

logger = logging.getLogger(__name__)

#: Forward arguments that are not conditioning: the latent input, the timestep and the output format.
NON_CONDITION_ARGUMENTS: Final = frozenset({"hidden_states", "timestep", "return_dict"})
#: Longest error / rate trace kept per request and branch.
MAX_TRACE: Final = 128


def _finite_or_none(value: float) -> float | None:
    return round(value, 6) if math.isfinite(value) else None


def _split_output(out: Any) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], Any] | None]:
    """The latent output of a model call and a function rebuilding the same structure around a new latent."""
    if isinstance(out, torch.Tensor):
        return out, lambda t: t
    if isinstance(out, tuple) and len(out) == 1 and isinstance(out[0], torch.Tensor):
        return out[0], lambda t: (t,)
    if isinstance(out, Mapping) and list(out.keys()) == ["sample"] and isinstance(out["sample"], torch.Tensor):
        cls = type(out)
        return out["sample"], lambda t: cls(sample=t)
    return None, None


class EasyCacheHandle(RecordedHandle):
    """The active EasyCache on one model (one expert of a routed denoiser).

    Args:
        model: the wrapped diffusers module.
        options: validated options.
        latent_channels: channels of the noisy latent inside ``hidden_states`` (``None``: all of them).
    """

    def __init__(self, model: nn.Module, options: Options, latent_channels: int | None) -> None:
        super().__init__(PLUGIN_NAME, PatchRecorder(PLUGIN_NAME), ExecutionLedger(PLUGIN_NAME, max_trace=MAX_TRACE))
        self.options = options
        self.latent_channels = latent_channels
        self._model_ref = weakref.ref(model)
        self._signature = inspect.signature(model.forward)
        self._requests: dict[str, RequestState] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ activation
    def install(self, model: nn.Module) -> None:
        """Wrap ``model.forward`` (recorded; undone by :meth:`deactivate`)."""
        with PatchRecorder(PLUGIN_NAME) as rec:
            rec.wrap_forward(model, self._make_wrapper, name=PLUGIN_NAME)
            self.patches = rec.pop_all()

    def _make_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def easycache_forward(*args: Any, **kwargs: Any) -> Any:
            return self._call(original, args, kwargs)

        return easycache_forward

    # ------------------------------------------------------------------ request lifecycle
    def begin_request(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._requests:
                raise RequestError(f"{PLUGIN_NAME}: request {request_id!r} is already active")
            state = self._requests[request_id] = RequestState(request_id, self.options.branch_decision)
            state.begun = True

    def prepare_request_schedule(self, request_id: str, schedule: RequestSchedule) -> None:
        """Store the request's immutable schedule (before its first model call).

        Raises:
            RequestError: malformed schedule, schedule prepared twice or after the first call, the request was not
                begun, or the schedule routes experts that do not all carry EasyCache in this session.
        """
        schedule = _validated_schedule(schedule)
        label, siblings = self._resolve_expert(schedule)
        with self._lock:
            state = self._requests.get(request_id)
            if state is None or not state.begun:
                raise RequestError(f"{PLUGIN_NAME}: request {request_id!r} is not active; begin it before its schedule")
        state.set_schedule(schedule, label, siblings)

    def end_request(self, request_id: str) -> None:
        """Release every tensor of the request and write its summary.

        Raises:
            RequestError: the request ended normally with a phase left incomplete (the tensors are released first).
        """
        with self._lock:
            state = self._requests.pop(request_id, None)
        if state is None:
            return
        in_flight = sys.exc_info()[1] is not None
        problems: list[str] = []
        if state.failure is not None:
            outcome = "failed"
        elif in_flight:
            outcome = "aborted"
        else:
            problems = state.completeness_problems()
            outcome = "incomplete" if problems else "completed"
        try:
            if state.started or problems:
                self.ledger.note("easycache", state.summary(outcome, problems), request_id=request_id)
                self.ledger.finish(request_id)
        finally:
            state.release()
        if problems:
            raise RequestError(f"{PLUGIN_NAME}: request {request_id!r} ended incomplete: " + "; ".join(problems))

    def release(self) -> None:
        with self._lock:
            states = list(self._requests.values())
            self._requests.clear()
        for state in states:
            state.release()

    # ------------------------------------------------------------------ diagnostics
    def active_requests(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._requests)

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor the handle holds now (cached transformations, inputs, snapshot copies)."""
        with self._lock:
            states = list(self._requests.values())
        return [t for state in states for t in state.tensors()]

    def phase_finished(self, request_id: str) -> bool:
        """This expert completed its phase of ``request_id`` (used to order routed experts)."""
        with self._lock:
            state = self._requests.get(request_id)
        return state is not None and state.phase_finished()

    # ------------------------------------------------------------------ expert resolution
    def _session_models(self) -> dict[str, nn.Module]:
        model = self._model_ref()
        session = get_session(model) if model is not None else None
        return session.models if session is not None else ({"model": model} if model is not None else {})

    def _resolve_expert(self, schedule: RequestSchedule) -> tuple[str, dict[str, Any]]:
        model = self._model_ref()
        session = get_session(model) if model is not None else None
        experts = [p.expert for p in schedule.phases]
        models = session.models if session is not None else {}
        if len(models) <= 1:
            if len(experts) != 1:
                raise RequestError(
                    f"{PLUGIN_NAME}: the schedule routes experts {experts} but EasyCache is installed on one model; "
                    "install EasyCache on every expert in one session"
                )
            return experts[0], {}
        handles = session.handles(self.name)  # type: ignore[union-attr]
        missing = [e for e in experts if e not in handles]
        if missing:
            raise RequestError(
                f"{PLUGIN_NAME}: expert(s) {missing} of the schedule have no EasyCache in this session "
                f"(installed on {sorted(handles)}); install EasyCache on every expert in one session"
            )
        label = next(lb for lb, m in models.items() if m is model)
        return label, {lb: h for lb, h in handles.items() if h is not self}

    # ------------------------------------------------------------------ the wrapped forward
    def _call(self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ctx = current_request()
        if ctx is None:
            raise RequestError(
                f"{PLUGIN_NAME}: the model was called outside a request. Call it through the native runner, or "
                "begin_request(id) and wrap each call in request_scope(RequestContext(id, branch, step_index, "
                "timestep, num_steps=...))"
            )
        with self._lock:
            state = self._requests.get(ctx.request_id)
        if state is None or not state.begun:
            raise RequestError(
                f"{PLUGIN_NAME}: request {ctx.request_id!r} was not begun on this model; call begin_request first"
            )
        if state.failure is not None:
            raise RequestError(
                f"{PLUGIN_NAME}: request {ctx.request_id!r} failed earlier ({state.failure}); "
                "end it and start a new one"
            )
        models = self._session_models()
        if state.label is None:
            state.label = next((lb for lb, m in models.items() if m is self._model_ref()), None)
        try:
            call = state.admit(ctx, routed=len(models) > 1)
            return self._run(state, call, original, args, kwargs)
        except BaseException as exc:
            state.failure = f"{type(exc).__name__} at step {ctx.step_index} ({ctx.branch or 'single'})"
            state.release()
            raise

    def _run(self, state: RequestState, call: Admission, original: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        rid = state.request_id
        record = state.branches[call.branch]
        arguments = kwargs if not args else self._signature.bind(*args, **kwargs).arguments
        hidden = arguments.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            raise InvalidRequestError(f"{PLUGIN_NAME}: hidden_states must be a tensor, got {type(hidden).__name__}")
        for name in RUNTIME_CONTROL_ARGUMENTS:
            if arguments.get(name) is not None:
                raise InvalidRequestError(f"{PLUGIN_NAME}: control input {name!r} is not supported with EasyCache")
        conditions = {k: v for k, v in arguments.items() if k not in NON_CONDITION_ARGUMENTS}
        ConditionSnapshot.validate(conditions)
        if self.options.dense:
            out = original(*args, **kwargs)
            record.mark(False)
            self.ledger.executed(ROOT_MODULE, "computed", request_id=rid)
            return out
        x = self._latent(hidden)

        if self._decide(state, call, record, x, conditions):
            out = record.rebuild(record.cache.estimate(x, record.out_dtype))  # type: ignore[misc,arg-type]
            record.mark(True)
            self.ledger.skipped("steps", request_id=rid)
            return out

        version = None if hidden.is_inference() else hidden._version
        out = original(*args, **kwargs)
        if version is not None and hidden._version != version:
            raise RequestError(f"{PLUGIN_NAME}: the model changed its input hidden_states in place")
        v, rebuild = _split_output(out)
        record.mark(False)
        if v is None or v.shape != x.shape:
            record.uncacheable = "output is not one latent of the input's shape"
            record.cache.clear()
            self.ledger.fallback(ROOT_MODULE, record.uncacheable, request_id=rid)
            return out
        record.cache.record_computed(x, v)
        record.snapshot = ConditionSnapshot.capture(conditions)
        record.rebuild = rebuild
        record.out_dtype = v.dtype
        self.ledger.executed(ROOT_MODULE, "computed", request_id=rid)
        return out

    def _latent(self, hidden: torch.Tensor) -> torch.Tensor:
        channels = self.latent_channels
        if channels is not None and hidden.dim() >= 2 and hidden.shape[1] > channels:
            return hidden[:, :channels]
        return hidden

    def _decide(self, state: RequestState, call: Admission, record: BranchRecord, x: torch.Tensor,
                conditions: dict[str, Any]) -> bool:
        """``True`` to reuse the cached transformation for this call."""
        opts = self.options
        gate = dense_gate(call.local, call.length, opts.warmup_steps, opts.final_dense_steps)
        if not call.decides:
            leader = state.group(call.group)
            return leader.skip and gate is None and self._reusable(state, record, x, conditions)
        group = state.group(call.group)
        if gate is not None or not self._reusable(state, record, x, conditions):
            group.accumulated = 0.0
            return False
        increment = record.cache.error_increment(x)
        if increment is None:
            group.accumulated = 0.0
            return False
        rate = record.cache.rate
        total, k = torch.stack([increment + group.accumulated, rate.float()]).tolist()  # type: ignore[union-attr]
        rid = state.request_id
        self.ledger.trace(f"accumulated_error.{call.branch}", _finite_or_none(total), request_id=rid)
        self.ledger.trace(f"k.{call.branch}", _finite_or_none(k), request_id=rid)
        if math.isfinite(total) and total < opts.threshold:
            group.accumulated = total
            group.skip = True
            record.cache.observe_input(x)
            return True
        group.accumulated = 0.0
        return False

    def _reusable(self, state: RequestState, record: BranchRecord, x: torch.Tensor, conditions: dict[str, Any]) -> bool:
        if record.uncacheable is not None or record.snapshot is None or not record.cache.can_reuse(x):
            return False
        change = record.snapshot.difference(conditions)
        if change is None:
            return True
        record.invalidate()
        self.ledger.count("snapshot_invalidations", request_id=state.request_id)
        self.ledger.trace("invalidated", change[:120], request_id=state.request_id)
        logger.debug("easycache: request %r: conditioning changed (%s); recomputing", state.request_id, change)
        return False


def _validated_schedule(schedule: Any) -> RequestSchedule:
    if not isinstance(schedule, RequestSchedule):
        raise RequestError(f"{PLUGIN_NAME}: expected a RequestSchedule, got {type(schedule).__name__}")
    rebuilt = RequestSchedule.from_steps(schedule.timesteps, schedule.experts)  # raises for malformed steps
    if rebuilt.phases != schedule.phases:
        raise RequestError(
            f"{PLUGIN_NAME}: malformed schedule: its phases {schedule.phases} do not match its steps "
            f"(build it with RequestSchedule.from_steps)"
        )
    return schedule
