"""Toy plugins for the lifecycle tests: real patches through PatchRecorder, counted calls, injectable faults."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
import torch.nn as nn

from worldfoundry.core.acceleration.handle import RecordedHandle
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.prepared import PreparedAcceleration
from worldfoundry.core.acceleration.receipts import ExecutionLedger
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.errors import AccelerationOptionsError

#: Distinct modules of the tiny Wan, one per toy plugin position (each holds a Linear).
TOY_TARGETS = ("blocks.0.ffn", "blocks.1.ffn", "blocks.0.attn2", "blocks.1.attn2", "proj_out")

_TOY_OPTION_KEYS = frozenset({"scale"})


class ToyHandle(RecordedHandle):
    """Tracks the requests it was told about; can refuse to begin one."""

    def __init__(self, name: str, patches: PatchRecorder, ledger: ExecutionLedger, plugin: ToyPlugin) -> None:
        super().__init__(name, patches, ledger)
        self.plugin = plugin
        self.requests: list[str] = []
        self.released = False

    def begin_request(self, request_id: str) -> None:
        if self.plugin.fail_begin:
            raise RuntimeError(f"{self.name} refuses request {request_id}")
        self.requests.append(request_id)

    def end_request(self, request_id: str) -> None:
        self.requests.remove(request_id)
        self.ledger.finish(request_id)

    def deactivate(self) -> None:
        if self.active and self.plugin.events is not None:
            self.plugin.events.append(("deactivate", self.name))
        super().deactivate()

    def release(self) -> None:
        self.released = True


class ToyPlugin:
    """A prepare factory. ``activate`` wraps ``target``'s forward (output * scale), swaps the weight Parameter
    of its first Linear for an equal copy, adds a buffer, a child module and a forward hook.

    Fault switches:
        fail_activate: "clean" raises inside the recorder block (the recorder undoes itself); "dirty" raises
            after making changes no recorder knows about (the installer's snapshot must repair them).
        fail_undo: deactivation partially fails: one recorded undo raises and one hidden change stays behind.
        mutate_in_prepare: prepare changes the model (forbidden).
    """

    def __init__(self, name: str, target: str, *, claims: Callable[[str], set[str]] | None = None,
                 incompatible_with: frozenset[str] = frozenset(), exact: bool | None = None) -> None:
        self.name = name
        self.target = target
        self.extra_claims = claims
        self.incompatible_with = incompatible_with
        self.exact = exact
        self.calls: Counter[str] = Counter()
        self.fail_activate: str | None = None
        self.fail_undo = False
        self.fail_begin = False
        self.mutate_in_prepare = False
        self.handles: list[ToyHandle] = []
        self.block_event: threading.Event | None = None
        self.events: list[tuple[str, str]] | None = None  # shared with the kit: activation/deactivation order
        self.entered_event: threading.Event | None = None

    def __call__(self, model: nn.Module, options: Mapping[str, Any], policy: Any) -> PreparedAcceleration:
        self.calls["prepare"] += 1
        unknown = sorted(set(options) - _TOY_OPTION_KEYS)
        if unknown:
            raise AccelerationOptionsError(self.name, f"unknown option(s) {unknown}; known: {sorted(_TOY_OPTION_KEYS)}")
        scale = float(options.get("scale", 1.0))
        module = model.get_submodule(self.target)
        if self.mutate_in_prepare:
            module.prepared_marker = True
        claims = {self.target}
        if self.extra_claims is not None:
            claims |= self.extra_claims(self.target)
        return PreparedAcceleration(
            name=self.name,
            claims=frozenset(claims),
            activate=lambda: self._activate(module, scale),
            incompatible_with=self.incompatible_with,
            options={"scale": scale},
            exact=self.exact if self.exact is not None else scale == 1.0,
        )

    def _activate(self, module: nn.Module, scale: float) -> ToyHandle:
        self.calls["activate"] += 1
        if self.events is not None:
            self.events.append(("activate", self.name))
        ledger = ExecutionLedger(self.name)
        linear = next(m for m in module.modules() if isinstance(m, nn.Linear))
        target = self.target
        with PatchRecorder(self.name) as rec:
            def make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
                def forward(*args: Any, **kwargs: Any) -> Any:
                    if self.block_event is not None:
                        if self.entered_event is not None:
                            self.entered_event.set()
                        self.block_event.wait(timeout=30)
                    ledger.executed(target, "toy")
                    out = original(*args, **kwargs)
                    return out * scale if scale != 1.0 else out

                return forward

            rec.wrap_forward(module, make_wrapper, name=self.name)
            rec.setattr(linear, "weight", nn.Parameter(linear.weight.detach().clone()))
            rec.register_buffer(module, f"_{self.name}_buffer", torch.zeros(3))
            rec.add_module(module, f"{self.name}_extra", nn.Identity())
            rec.hook(module.register_forward_hook(lambda m, a, o: None), f"{self.name} hook")
            if self.fail_activate == "clean":
                raise RuntimeError(f"{self.name}: activation failed (clean)")
            if self.fail_activate == "dirty":
                patches = rec.pop_all()  # leave everything in place, as a careless plugin would
                module.leftover_attribute = "dirty"
                linear._parameters["bias"] = nn.Parameter(linear.bias.detach().clone())
                raise RuntimeError(f"{self.name}: activation failed (dirty)")
            if self.fail_undo:
                hidden_old = linear._parameters["bias"]
                linear._parameters["bias"] = nn.Parameter(hidden_old.detach().clone())

                def broken_undo() -> None:
                    raise RuntimeError(f"{self.name}: undo failed")

                rec.callback(broken_undo, "restore bias (fails)")
                rec.setattr(module, "late_attribute", 1)
            patches = rec.pop_all()
        handle = ToyHandle(self.name, patches, ledger, self)
        self.handles.append(handle)
        return handle

    def deactivate_count(self) -> int:
        return sum(1 for h in self.handles if not h.active)


class ToyKit:
    """Builds a fresh registry with toy plugins (no entry-point discovery)."""

    def __init__(self) -> None:
        self.registry = AccelerationRegistry(discover=False)
        self.plugins: dict[str, ToyPlugin] = {}
        self.events: list[tuple[str, str]] = []

    def add(self, name: str, target: str | None = None, **kwargs: Any) -> ToyPlugin:
        plugin = ToyPlugin(name, target or TOY_TARGETS[len(self.plugins) % len(TOY_TARGETS)], **kwargs)
        plugin.events = self.events
        self.registry.register(name, plugin)
        self.plugins[name] = plugin
        return plugin

    def activations(self) -> int:
        return sum(p.calls["activate"] for p in self.plugins.values())


@pytest.fixture
def toy_kit() -> ToyKit:
    return ToyKit()


@pytest.fixture
def toy_kit_factory() -> Callable[[], ToyKit]:
    return ToyKit
