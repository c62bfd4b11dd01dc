"""The other plugins of a session, seen from a captured forward.

Capturing a forward freezes its Python: on a replay only the kernels run. For the plugins installed beside the
graph that means three things, handled here without importing any of them:

* **receipts** — every call a plugin makes to its :class:`~worldfoundry.core.acceleration.receipts.ExecutionLedger`
  while the forward is captured is kept (:meth:`ExecutionLedger.divert`) and applied again once per replay, for the
  request that replays; a handle's ``fold_counts()`` (plain counters folded into the ledger) is called inside the
  capture so its counts are kept the same way;
* **per-call state** — a handle may implement ``graph_call() -> GraphCall | None``, called on every model call
  after the model's forward pre-hooks ran. It says which request-independent state selects the path the forward
  takes (``key``, part of the signature), which of its own tensors that path reads (``tensors``: copied into
  graph-owned buffers before each replay, so one graph serves every request and CFG branch), how to make the
  forward read those buffers while it is captured (``serve``), what to count when a replay ran (``replayed``), or
  that this call must run eagerly (``eager_reason``);
* **composability** — a plugin without ``graph_call`` composes when it declares ``cuda_graph_safe = True`` on its
  handle or its name is listed as safe by the graph plugin (its forward has no per-call Python state beyond ledger
  calls); any other plugin makes every call run eagerly, with its name in the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch

from worldfoundry.core.acceleration.receipts import ExecutionLedger, LedgerCall


@dataclass
class GraphCall:
    """A co-installed plugin's answer for the call being made (see the module docstring).

    Attributes:
        key: request-independent state that selects the captured path (hashable).
        tensors: the plugin's tensors that path reads, in a fixed order.
        serve: ``serve(buffers)`` -> context manager inside which the forward reads ``buffers`` instead of
            ``tensors`` and leaves no per-call counts behind; what it yields (a token, e.g. the counts it took
            back) is kept with the capture.
        replayed: ``replayed(token)``, called once after every execution of the captured path (the warm-up with
            its own token, every replay with the capture's), to count what the frozen Python would have counted.
        eager_reason: run this call eagerly (e.g. a cache is not filled yet).
    """

    key: Hashable = ()
    tensors: tuple[torch.Tensor, ...] = ()
    serve: Callable[[Sequence[torch.Tensor]], ContextManager[Any]] | None = None
    replayed: Callable[[Any], None] | None = None
    eager_reason: str | None = None


@dataclass
class Participant:
    """One co-installed plugin on the captured model."""

    name: str
    handle: Any
    ledger: ExecutionLedger | None
    graph_call: Callable[[], GraphCall | None] | None
    fold: Callable[[], None] | None


@dataclass
class Participants:
    """The co-installed plugins of a session and whether they compose with capture."""

    members: list[Participant] = field(default_factory=list)
    #: non-empty: every call runs eagerly for this reason
    refusal: str = ""

    def calls(self) -> tuple[list[tuple[Participant, GraphCall]], str]:
        """Ask every participant with ``graph_call`` about this call: ``([(participant, call)], eager reason)``."""
        out: list[tuple[Participant, GraphCall]] = []
        for member in self.members:
            if member.graph_call is None:
                continue
            call = member.graph_call()
            if call is None:
                continue
            if call.eager_reason:
                return out, f"{member.name}: {call.eager_reason}"
            out.append((member, call))
        return out, ""

    def fold(self) -> None:
        for member in self.members:
            if member.fold is not None:
                member.fold()

    @contextlib.contextmanager
    def diverted(self) -> Iterator[list[tuple[ExecutionLedger, list[LedgerCall]]]]:
        """Every participant's ledger diverted inside the block; yields ``[(ledger, kept calls)]``."""
        kept: list[tuple[ExecutionLedger, list[LedgerCall]]] = []
        with contextlib.ExitStack() as stack:
            seen: set[int] = set()
            for member in self.members:
                ledger = member.ledger
                if ledger is None or id(ledger) in seen:
                    continue
                seen.add(id(ledger))
                kept.append((ledger, stack.enter_context(ledger.divert())))
            yield kept


def gather(session: Any, model: Any, own: str, safe_names: frozenset[str]) -> Participants:
    """The participants of ``session`` on ``model`` (one expert), other than the plugin named ``own``.

    Args:
        session: the :class:`~worldfoundry.core.acceleration.session.AccelerationSession` attached to the model
            (``None``: no other plugin).
        model: the captured module.
        own: the graph plugin's name.
        safe_names: plugin names known to compose without ``graph_call``.
    """
    result = Participants()
    if session is None:
        return result
    label = next((lb for lb, m in session.models.items() if m is model), None)
    for name in session.names:
        if name == own:
            continue
        handle = session.handles(name).get(label) if label is not None else None
        if handle is None:
            continue
        graph_call = getattr(handle, "graph_call", None)
        if graph_call is None and not getattr(handle, "cuda_graph_safe", False) and name not in safe_names:
            result.refusal = (f"{name} does not declare CUDA-graph support (its per-call Python would be frozen); "
                              "list it in compose_with only if its forward has no per-call state")
        ledger = getattr(handle, "ledger", None)
        result.members.append(Participant(
            name, handle, ledger if isinstance(ledger, ExecutionLedger) else None, graph_call,
            getattr(handle, "fold_counts", None)))
    return result


__all__ = ["GraphCall", "Participant", "Participants", "gather"]
