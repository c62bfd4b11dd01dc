"""The request context the runner sets around every denoiser call; plugins read it to key their state."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

NO_REQUEST = "<no-request>"


@dataclass(frozen=True)
class RequestContext:
    """Who is calling the model right now.

    Attributes:
        request_id: explicit id of the request (the runner always sets one).
        branch: ``"cond"`` or ``"uncond"`` (classifier-free guidance branch), ``None`` when unknown.
        step_index: global zero-based denoising step.
        timestep: the scheduler timestep of this step.
        expert: label of the expert being called (``"high"``/``"low"`` for Wan2.2, ``None`` for one model).
        num_steps: total denoising steps of the request.
        expert_step_index / expert_phase_length: the expert-local zero-based step and the number of steps
            that expert runs, from the request schedule.
    """

    request_id: str
    branch: str | None = None
    step_index: int | None = None
    timestep: float | None = None
    expert: str | None = None
    num_steps: int | None = None
    expert_step_index: int | None = None
    expert_phase_length: int | None = None

    def with_(self, **changes: Any) -> RequestContext:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


_CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("worldfoundry_request", default=None)


def current_request() -> RequestContext | None:
    """The innermost active :class:`RequestContext`, or ``None`` outside any request."""
    return _CURRENT.get()


def current_request_id() -> str:
    ctx = _CURRENT.get()
    return ctx.request_id if ctx is not None else NO_REQUEST


@contextlib.contextmanager
def request_scope(ctx: RequestContext) -> Iterator[RequestContext]:
    """Make ``ctx`` the current request context inside the block."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def enter_request_context(ctx: RequestContext | None) -> contextvars.Token[RequestContext | None]:
    """Make ``ctx`` current until :func:`leave_request_context` (for hooks that cannot use a ``with`` block).

    Returns:
        The token to hand back to :func:`leave_request_context`.
    """
    return _CURRENT.set(ctx)


def leave_request_context(token: contextvars.Token[RequestContext | None]) -> None:
    """Undo one :func:`enter_request_context` (tokens are handed back innermost first)."""
    _CURRENT.reset(token)


def replace_request_context(ctx: RequestContext | None) -> None:
    """Set the current context outright (to put back the caller's after an interrupted call)."""
    _CURRENT.set(ctx)
