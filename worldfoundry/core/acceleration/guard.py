"""``RequestGuard``: counts active forwards and explicit requests so nothing changes a model while it runs."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch.nn as nn

from worldfoundry.errors import ModelBusyError, RequestError

logger = logging.getLogger(__name__)

GUARD_ATTRIBUTE = "_worldfoundry_guard"


class RequestListener(Protocol):
    def on_begin_request(self, request_id: str) -> None: ...

    def on_end_request(self, request_id: str) -> None: ...


class RequestGuard:
    """Thread-safe activity tracker shared by every module of one guard group (e.g. both Wan2.2 experts).

    It counts forwards in flight (through forward hooks on each attached module) and explicit request ids
    (:meth:`begin_request` / :meth:`end_request`). Installing or uninstalling accelerations happens inside
    :meth:`mutation`, which refuses while anything is active and makes new forwards/requests wait-free fail.
    """

    def __init__(self, name: str = "guard") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._forwards = 0
        self._requests: dict[str, int] = {}  # request id -> the thread that began it
        self._mutating: str | None = None
        self._mutating_thread: int | None = None
        self._listeners: list[RequestListener] = []
        self._modules: dict[int, tuple[Any, ...]] = {}  # id(module) -> its hook handles
        self._local = threading.local()

    def __reduce__(self) -> tuple[Any, ...]:
        """Copies and pickles are a fresh, idle guard of the same name (locks, counts and listeners are
        per process and per run; a copied model is a new model)."""
        return (RequestGuard, (self.name,))

    # ------------------------------------------------------------------ state
    @property
    def active_forwards(self) -> int:
        with self._lock:
            return self._forwards

    def active_request_ids(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._requests)

    def is_busy(self) -> bool:
        with self._lock:
            return bool(self._forwards or self._requests or self._mutating)

    def ensure_idle(self, action: str) -> None:
        with self._lock:
            self._raise_if_busy(action)

    def _raise_if_busy(self, action: str) -> None:
        if self._forwards or self._requests or self._mutating:
            raise ModelBusyError(action, tuple(self._requests), self._forwards, self._mutating is not None)

    # ------------------------------------------------------------------ forwards (hooks)
    def _enter_forward(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        with self._lock:
            if self._mutating is not None:
                raise ModelBusyError("run a forward", tuple(self._requests), self._forwards, True)
            self._forwards += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def _exit_forward(self, module: nn.Module, args: Any, *rest: Any) -> None:
        # torch runs always-called hooks even when the pre-hook raised; only undo what this thread entered.
        depth = getattr(self._local, "depth", 0)
        if depth <= 0:
            return
        self._local.depth = depth - 1
        with self._lock:
            self._forwards -= 1

    def release_thread_forwards(self) -> int:
        """Forget forwards this thread entered but never left (a ``KeyboardInterrupt`` skips torch's
        always-called hooks) and tell the listeners (``on_release_thread``). The runner calls it when a request
        fails. Returns how many were released."""
        depth = getattr(self._local, "depth", 0)
        if depth > 0:
            self._local.depth = 0
            with self._lock:
                self._forwards -= depth
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:  # plugins with per-thread forward state forget it too
            release = getattr(listener, "on_release_thread", None)
            if release is not None:
                release()
        return depth

    # ------------------------------------------------------------------ explicit requests
    def begin_request(self, request_id: str) -> None:
        """Mark ``request_id`` active. Listeners (an installed session) are told after the id is registered.

        Raises:
            RequestError: the id is already active or not a non-empty string.
            ModelBusyError: an install/uninstall is in progress.
        """
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}")
        with self._lock:
            if self._mutating is not None:
                raise ModelBusyError("begin a request", tuple(self._requests), self._forwards, True)
            if request_id in self._requests:
                raise RequestError(f"request id {request_id!r} is already active; use a unique id per request")
            self._requests[request_id] = threading.get_ident()
            listeners = list(self._listeners)
        try:
            for listener in listeners:
                listener.on_begin_request(request_id)
        except BaseException:
            with self._lock:
                self._requests.pop(request_id, None)
            raise

    def end_request(self, request_id: str) -> None:
        """Release ``request_id``. The id is released even when a listener raises (the error is re-raised).

        Raises:
            RequestError: the id is not active.
        """
        with self._lock:
            if request_id not in self._requests:
                raise RequestError(
                    f"request id {request_id!r} is not active (active: {list(self._requests) or 'none'})"
                )
            listeners = list(self._listeners)
        try:
            errors: list[BaseException] = []
            for listener in reversed(listeners):
                try:
                    listener.on_end_request(request_id)
                except BaseException as exc:  # release every listener, then report
                    errors.append(exc)
            if errors:
                raise errors[0]
        finally:
            with self._lock:
                self._requests.pop(request_id, None)

    @contextlib.contextmanager
    def request(self, request_id: str) -> Iterator[str]:
        """``with guard.request("r1"): ...`` — begin, then always end (also on exceptions)."""
        self.begin_request(request_id)
        try:
            yield request_id
        finally:
            self.end_request(request_id)

    # ------------------------------------------------------------------ mutation
    @contextlib.contextmanager
    def mutation(self, action: str) -> Iterator[None]:
        """Exclusive section for install/uninstall. Raises :class:`ModelBusyError` when anything is active."""
        with self._lock:
            self._raise_if_busy(action)
            self._mutating = action
            self._mutating_thread = threading.get_ident()
        try:
            yield
        finally:
            with self._lock:
                self._mutating = None
                self._mutating_thread = None

    def check_move(self, action: str = "move the model (.to / dtype / device)") -> None:
        """Refuse a move of the model's tensors while another thread runs it.

        A move from the thread that runs the request (accelerate's CPU-offload hooks move modules between
        calls) is allowed; a move from any other thread while a request or forward is active, or while an
        install/uninstall runs elsewhere, would change tensors under the running request.

        Raises:
            ModelBusyError: naming the active requests.
        """
        me = threading.get_ident()
        with self._lock:
            others = [rid for rid, owner in self._requests.items() if owner != me]
            foreign_forwards = self._forwards - getattr(self._local, "depth", 0)
            foreign_mutation = self._mutating is not None and self._mutating_thread != me
            if others or foreign_forwards > 0 or foreign_mutation:
                raise ModelBusyError(f"{action} from another thread", tuple(others), max(foreign_forwards, 0),
                                     foreign_mutation)

    def add_listener(self, listener: RequestListener) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)

    def remove_listener(self, listener: RequestListener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def __repr__(self) -> str:
        return (
            f"RequestGuard({self.name!r}, forwards={self._forwards}, requests={list(self._requests)}, "
            f"modules={len(self._modules)})"
        )


class GuardedApply:
    """The instance ``_apply`` of a guarded model: refuses a move from another thread while the model runs
    (see :meth:`RequestGuard.check_move`), then runs the class's own ``_apply``. Picklable."""

    def __init__(self, guard: RequestGuard, model: nn.Module, previous: Any) -> None:
        self.guard = guard
        self.model = model
        self.previous = previous  # the instance ``_apply`` it replaced (``None``: none)

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.guard.check_move()
        return type(self.model)._apply(self.model, fn, *args, **kwargs)


def attach_request_guard(model: nn.Module, guard: RequestGuard | None = None) -> RequestGuard:
    """Attach a guard to ``model`` (or join ``guard``'s group). Idempotent for the same guard.

    The guard adds a forward pre-hook, an always-called forward hook, the ``_worldfoundry_guard`` attribute and
    an instance ``_apply`` (cross-thread move refusal); :func:`detach_request_guard` removes exactly these.

    Returns:
        The guard now attached to ``model``.

    Raises:
        ValueError: ``model`` already has a different guard.
    """
    with _ATTACH_LOCK:
        existing = get_request_guard(model)
        if existing is not None:
            if guard is not None and guard is not existing:
                raise ValueError("model already has a different request guard; guard groups are fixed when loading")
            return existing
        guard = guard or RequestGuard(type(model).__name__)
        pre = model.register_forward_pre_hook(guard._enter_forward)
        post = model.register_forward_hook(guard._exit_forward, always_call=True)
        object.__setattr__(model, "_apply", GuardedApply(guard, model, model.__dict__.get("_apply")))
        object.__setattr__(model, GUARD_ATTRIBUTE, guard)
        guard._modules[id(model)] = (pre, post)  # the hook handles (weak), for diagnostics
        return guard


def detach_request_guard(model: nn.Module) -> bool:
    """Remove what :func:`attach_request_guard` added to ``model`` (hooks, attribute, ``_apply``).

    Returns:
        ``True`` when a guard was detached, ``False`` when ``model`` had none.

    Raises:
        ModelBusyError: the guard is running a request or forward.
    """
    with _ATTACH_LOCK:
        guard = get_request_guard(model)
        if guard is None:
            return False
        with guard._lock:
            if guard._forwards or guard._requests:
                raise ModelBusyError("detach the request guard", tuple(guard._requests), guard._forwards)
            guard._modules.pop(id(model), None)
        for hooks in (model._forward_pre_hooks, model._forward_hooks):
            for hook_id in [k for k, fn in hooks.items() if getattr(fn, "__self__", None) is guard]:
                del hooks[hook_id]
                model._forward_hooks_always_called.pop(hook_id, None)
                model._forward_hooks_with_kwargs.pop(hook_id, None)
                model._forward_pre_hooks_with_kwargs.pop(hook_id, None)
        apply = model.__dict__.get("_apply")
        if isinstance(apply, GuardedApply) and apply.guard is guard:
            if apply.previous is None:
                del model.__dict__["_apply"]
            else:
                model.__dict__["_apply"] = apply.previous
        del model.__dict__[GUARD_ATTRIBUTE]
        return True


_ATTACH_LOCK = threading.Lock()


def get_request_guard(model: nn.Module) -> RequestGuard | None:
    return model.__dict__.get(GUARD_ATTRIBUTE)
