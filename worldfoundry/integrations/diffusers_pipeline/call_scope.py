"""The request context of a diffusers pipeline call, as the DiTs see it.

While a ``pipe(...)`` call runs (:class:`PipelineCall` is current), every forward of one of the pipeline's DiTs
runs inside a :class:`~worldfoundry.core.acceleration.context.RequestContext` carrying the call's request id,
the CFG branch (the name of diffusers' enclosing ``model.cache_context("cond"/"uncond")``; ``None`` where a
pipeline batches both branches in one call, like SANA-Video), the step (scheduler ``step()`` calls so far), its
timestep and the expert's place in the routed schedule. The schedule is read from the scheduler at the first DiT
forward of the call and handed to the session (``prepare_request_schedule``) before that forward runs.

:class:`PipelineScope` makes the per-DiT changes (a forward pre-hook placed first, an always-called forward hook,
a wrapper around ``cache_context`` that still enters diffusers' own) through a recorded
:class:`~worldfoundry.core.acceleration.patching.PatchRecorder`, so uninstall removes exactly them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn as nn

from worldfoundry.core.acceleration.context import (
    RequestContext,
    current_request,
    enter_request_context,
    leave_request_context,
)
from worldfoundry.core.acceleration.handle import RecordedHandle
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.schedule import RequestSchedule
from worldfoundry.integrations.diffusers_pipeline.components import call_schedule

SCOPE_NAME = "pipeline_scope"

#: ``(id(module), name)`` of the innermost ``cache_context`` entered on a DiT.
_CACHE_CONTEXT: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar(
    "worldfoundry_cache_context", default=None)
#: The pipeline call running in this context.
_ACTIVE_CALL: contextvars.ContextVar[PipelineCall | None] = contextvars.ContextVar(
    "worldfoundry_pipeline_call", default=None)


class PipelineCall:
    """One ``pipe(...)`` call: its request id, schedule (set at the first DiT forward) and step counter."""

    def __init__(self, request_id: str, pipe: Any, scope: PipelineScope, on_schedule: Callable[..., None]) -> None:
        self.request_id = request_id
        self.pipe = pipe
        self.scope = scope
        self.on_schedule = on_schedule
        self.schedule: RequestSchedule | None = None
        self.step = 0
        self.forwards: dict[str, int] = {}

    def context_for(self, label: str, module: nn.Module) -> RequestContext:
        """The request context of a forward of expert ``label`` now."""
        if self.schedule is None:
            schedule = call_schedule(self.pipe, self.scope.labels)
            self.on_schedule(self.request_id, schedule)
            self.schedule = schedule
        schedule = self.schedule
        step = min(self.step, schedule.num_steps - 1)
        placement = schedule.locate(step)
        entered = _CACHE_CONTEXT.get()
        branch = entered[1] if entered is not None and entered[0] == id(module) else None
        mine = placement.expert == label
        self.forwards[label] = self.forwards.get(label, 0) + 1
        return RequestContext(
            self.request_id, branch, step, placement.timestep, label, schedule.num_steps,
            placement.expert_step_index if mine else None, placement.expert_phase_length if mine else None,
        )

    @contextlib.contextmanager
    def counting_scheduler_steps(self) -> Iterator[None]:
        """Count ``pipe.scheduler.step`` calls during the call (an instance attribute, removed afterwards)."""
        scheduler = self.pipe.scheduler
        before = scheduler.__dict__.get("step", _ABSENT)
        original = scheduler.step

        def step(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self.step += 1
            return out

        functools.update_wrapper(step, original)
        scheduler.__dict__["step"] = step
        try:
            yield
        finally:
            if scheduler.__dict__.get("step") is step:
                if before is _ABSENT:
                    del scheduler.__dict__["step"]
                else:
                    scheduler.__dict__["step"] = before

    @contextlib.contextmanager
    def current(self) -> Iterator[PipelineCall]:
        token = _ACTIVE_CALL.set(self)
        try:
            yield self
        finally:
            _ACTIVE_CALL.reset(token)


class PipelineScope(RecordedHandle):
    """The recorded per-DiT changes that give each forward of a pipeline call its request context.

    Args:
        dits: the session's label -> module.
    """

    def __init__(self, dits: dict[str, nn.Module]) -> None:
        super().__init__(SCOPE_NAME, PatchRecorder(SCOPE_NAME))
        self.dits = dict(dits)
        self.labels = list(dits)
        self._local = threading.local()

    def install(self, extra: Callable[[PatchRecorder], None] | None = None) -> None:
        """Hook every DiT (and run ``extra`` with the same recorder); on failure nothing stays."""
        with PatchRecorder(SCOPE_NAME) as rec:
            for label, module in self.dits.items():
                rec.hook(module.register_forward_pre_hook(functools.partial(self._enter, label), prepend=True),
                         f"request-context pre-hook on {label}")
                rec.hook(module.register_forward_hook(self._exit, always_call=True),
                         f"request-context hook on {label}")
                if callable(getattr(module, "cache_context", None)):
                    rec.setattr(module, "cache_context", _branch_marking(module, module.cache_context))
            if extra is not None:
                extra(rec)
            self.patches = rec.pop_all()

    def _stack(self) -> list[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _enter(self, label: str, module: nn.Module, args: Any) -> None:
        stack = self._stack()
        stack.append(None)  # pushed first: the always-called hook pops it even when this hook raises
        call = _ACTIVE_CALL.get()
        if call is None or call.scope is not self or current_request() is not None:
            return
        stack[-1] = enter_request_context(call.context_for(label, module))

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if stack:
            token = stack.pop()
            if token is not None:
                leave_request_context(token)

    def reset_thread(self) -> None:
        """Forget contexts this thread entered but never left (an interrupt skipped the always-called hook)."""
        self._local.stack = []


def _branch_marking(module: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
    """``cache_context`` that remembers its name for the request context, then enters diffusers' own."""

    @contextlib.contextmanager
    def cache_context(name: str, **kwargs: Any) -> Iterator[None]:
        token = _CACHE_CONTEXT.set((id(module), name))
        try:
            with original(name, **kwargs):
                yield
        finally:
            _CACHE_CONTEXT.reset(token)

    functools.update_wrapper(cache_context, original)
    return cache_context


_ABSENT = object()

__all__ = ["SCOPE_NAME", "PipelineCall", "PipelineScope"]
