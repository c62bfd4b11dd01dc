"""``accelerate_pipeline(pipe, spec)``: accelerations on a diffusers pipeline, with a request per call.

Example:
    >>> import worldfoundry
    >>> accel = worldfoundry.accelerate(pipe, {"easycache": {"threshold": 0.0}})    # doctest: +SKIP
    >>> video = pipe(prompt_embeds=..., num_inference_steps=4).frames               # doctest: +SKIP
    >>> accel.last_call.plugins["easycache"]["model"]["counters"]                   # doctest: +SKIP
    >>> accel.uninstall()                                                           # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from worldfoundry.core.acceleration.context import current_request, replace_request_context
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.acceleration.session import AccelerationSession
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import RequestError, SessionAlreadyInstalledError
from worldfoundry.integrations.diffusers_pipeline.call_scope import SCOPE_NAME, PipelineCall, PipelineScope
from worldfoundry.integrations.diffusers_pipeline.components import pipeline_dits
from worldfoundry.integrations.diffusers_pipeline.pipeline_class import PIPELINE_ATTRIBUTE, accelerated_class

logger = logging.getLogger(__name__)

#: Receipts of the most recent calls kept per pipeline.
MAX_CALL_RECEIPTS = 16

_CALLER_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "worldfoundry_pipeline_request_id", default=None)


@dataclass(frozen=True)
class PipelineCallReceipt:
    """What one ``pipe(...)`` call ran: its request id, outcome, schedule and each plugin's request record.

    Attributes:
        plugins: ``{plugin: {expert: the request's ledger record}}`` (counters, modules, fallbacks, notes).
    """

    request_id: str
    outcome: str
    schedule: dict[str, Any] | None
    forwards: dict[str, int]
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "outcome": self.outcome, "schedule": self.schedule,
                "forwards": dict(self.forwards), "plugins": self.plugins}


class PipelineAcceleration:
    """The accelerations installed on a pipeline (returned by :func:`accelerate_pipeline`).

    It behaves like the session on its DiTs (``names``, ``receipt``, ``installed``, ``models``, ``handles``,
    ``execution_report``, ``uninstall``) and adds the per-call receipts (``calls``, ``last_call``) and
    :meth:`request` to name the next calls' request id.
    """

    def __init__(self, pipe: Any, session: AccelerationSession, scope: PipelineScope) -> None:
        self._pipe = pipe
        self.session = session
        self.scope = scope
        self._ids = itertools.count()
        self._prefix = f"{type(pipe).__name__}-{uuid.uuid4().hex[:8]}"
        self._calls: deque[PipelineCallReceipt] = deque(maxlen=MAX_CALL_RECEIPTS)
        self._running = threading.Lock()

    # ------------------------------------------------------------------ the session's face
    @property
    def installed(self) -> bool:
        return self.session.installed

    @property
    def names(self) -> tuple[str, ...]:
        return self.session.names

    @property
    def receipt(self) -> Any:
        return self.session.receipt

    @property
    def models(self) -> dict[str, Any]:
        return self.session.models

    def handles(self, name: str) -> dict[str, Any]:
        return self.session.handles(name)

    def execution_report(self) -> dict[str, Any]:
        report = self.session.execution_report()
        report["calls"] = [c.to_json() for c in self._calls]
        return report

    def uninstall(self) -> None:
        """Uninstall from every DiT and give the pipeline its class back (see ``AccelerationSession.uninstall``)."""
        self.session.uninstall()

    @property
    def calls(self) -> tuple[PipelineCallReceipt, ...]:
        return tuple(self._calls)

    @property
    def last_call(self) -> PipelineCallReceipt | None:
        return self._calls[-1] if self._calls else None

    @contextlib.contextmanager
    def request(self, request_id: str) -> Iterator[str]:
        """``with accel.request("r1"): pipe(...)`` — the calls inside use ``request_id`` (one at a time)."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}")
        token = _CALLER_REQUEST_ID.set(request_id)
        try:
            yield request_id
        finally:
            _CALLER_REQUEST_ID.reset(token)

    # ------------------------------------------------------------------ one call
    def run_call(self, call_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the pipeline's own ``__call__`` as one request: begun, scoped, ended in ``finally``."""
        caller = current_request()
        rid = _CALLER_REQUEST_ID.get() or (caller.request_id if caller is not None else None)
        rid = rid or f"{self._prefix}-{next(self._ids)}"
        if not self._running.acquire(blocking=False):
            raise RequestError(f"{type(self._pipe).__name__} is already running a call; one call at a time per "
                               "pipeline object (its scheduler keeps per-call state)")
        try:
            return self._run_request(rid, call_fn, args, kwargs, caller)
        finally:
            self._running.release()

    def _run_request(self, rid: str, call_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                     caller: Any) -> Any:
        guard = self.session.guard
        call = PipelineCall(rid, self._pipe, self.scope, self.session.prepare_request_schedule)
        guard.begin_request(rid)
        outcome = "failed"
        replace_request_context(None)
        try:
            with call.current(), call.counting_scheduler_steps():
                try:
                    result = call_fn(*args, **kwargs)
                except BaseException:
                    guard.release_thread_forwards()
                    self._end_after_failure(rid)
                    raise
            guard.end_request(rid)  # may raise: e.g. a plugin saw its phase incomplete (released anyway)
            outcome = "completed"
            return result
        finally:
            replace_request_context(caller)
            self.scope.reset_thread()
            self._calls.append(self._receipt(call, outcome))

    def _end_after_failure(self, rid: str) -> None:
        try:
            self.session.guard.end_request(rid)
        except Exception as exc:  # the call's own failure is the one to report
            logger.error("ending request %r after a failed pipeline call also failed: %s", rid, exc)

    def _receipt(self, call: PipelineCall, outcome: str) -> PipelineCallReceipt:
        plugins: dict[str, dict[str, Any]] = {}
        try:
            report = self.session.execution_report()["plugins"]
        except Exception as exc:  # a receipt must never hide the call's result or error
            logger.error("collecting the receipts of request %r failed: %s", call.request_id, exc)
            report = {}
        for name, experts in report.items():
            for expert, entry in experts.items():
                requests = entry.get("requests") if isinstance(entry, Mapping) else None
                record = requests.get(call.request_id) if isinstance(requests, Mapping) else None
                if record is not None:
                    plugins.setdefault(name, {})[expert] = record
        schedule = call.schedule.to_json() if call.schedule is not None else None
        return PipelineCallReceipt(call.request_id, outcome, schedule, dict(call.forwards), plugins)

    def __repr__(self) -> str:
        state = "installed" if self.installed else "uninstalled"
        return f"PipelineAcceleration({type(self._pipe).__name__}, {list(self.names)}, {state})"


def accelerate_pipeline(pipe: Any, spec: Mapping[str, Any], policy: RuntimePolicy | None = None, *,
                        registry: AccelerationRegistry | None = None) -> PipelineAcceleration:
    """Install accelerations on every DiT of a diffusers pipeline, with a request scope per ``pipe(...)`` call.

    Both experts of a Wan 2.2 pipeline (``transformer``, ``transformer_2``) are installed as one session and
    guarded together; each call begins a request (automatic id, or the one given with
    :meth:`PipelineAcceleration.request`), maps diffusers' ``cache_context("cond"/"uncond")`` and scheduler steps
    into the request context, prepares the routed schedule from the pipeline's ``boundary_ratio`` and ends the
    request in ``finally``.

    Args:
        pipe: a diffusers ``DiffusionPipeline`` (WanPipeline, WanImageToVideoPipeline, SanaVideoPipeline, ...).
        spec: ``{name: options mapping or True}``.
        policy: handed to every factory (default: the first DiT's device and dtype).
        registry: where names are looked up.

    Returns:
        The :class:`PipelineAcceleration`, also at ``pipe._worldfoundry_accelerations``.

    Raises:
        SessionAlreadyInstalledError: the pipeline (or one of its DiTs) already carries accelerations.
        Everything :func:`install_diffusion_accelerations` raises; nothing is changed then.
    """
    existing = pipe.__dict__.get(PIPELINE_ATTRIBUTE)
    if existing is not None and existing.installed:
        raise SessionAlreadyInstalledError(existing.names)
    dits = pipeline_dits(pipe)
    session = install_diffusion_accelerations(dits if len(dits) > 1 else next(iter(dits.values())), spec, policy,
                                              registry=registry)
    scope = PipelineScope(dits)
    accel = PipelineAcceleration(pipe, session, scope)
    try:
        with session.guard.mutation("install the pipeline request scope"):
            scope.install(lambda rec: _mark_pipeline(rec, pipe, accel))
            session.add_companion(SCOPE_NAME, scope)
    except BaseException:
        session.uninstall()
        raise
    return accel


def _mark_pipeline(rec: PatchRecorder, pipe: Any, accel: PipelineAcceleration) -> None:
    """Give ``pipe`` its accelerated class and the attribute (both recorded, both collision-checked)."""
    base = type(pipe)
    cls = accelerated_class(base)
    object.__setattr__(pipe, "__class__", cls)

    def undo_class() -> None:
        object.__setattr__(pipe, "__class__", base)

    def check_class() -> str | None:
        return None if type(pipe) is cls else f"the pipeline's class was changed to {type(pipe).__name__} since install"

    rec.callback(undo_class, f"{base.__name__} class", check=check_class)
    previous = pipe.__dict__.get(PIPELINE_ATTRIBUTE, _ABSENT)
    pipe.__dict__[PIPELINE_ATTRIBUTE] = accel

    def undo_attribute() -> None:
        if previous is _ABSENT:
            pipe.__dict__.pop(PIPELINE_ATTRIBUTE, None)
        else:
            pipe.__dict__[PIPELINE_ATTRIBUTE] = previous

    rec.callback(undo_attribute, f"{base.__name__}.{PIPELINE_ATTRIBUTE}")


_ABSENT = object()

__all__ = ["MAX_CALL_RECEIPTS", "PipelineAcceleration", "PipelineCallReceipt", "accelerate_pipeline"]
