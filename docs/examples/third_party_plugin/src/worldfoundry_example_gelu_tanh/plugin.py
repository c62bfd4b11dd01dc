"""Glue: the hook that registers ``example_gelu_tanh``, its prepare factory and its handle.

``prepare`` only validates and returns a :class:`PreparedAcceleration`; ``activate`` wraps the forward of
each selected ``blocks.<i>.ffn.net.0`` (diffusers' ``GELU(approximate="tanh")``: projection then GELU) through
a :class:`PatchRecorder`, so uninstalling restores the original forwards exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

import worldfoundry
from worldfoundry.plugin import (
    AccelerationOptionsError,
    AccelerationRefusedError,
    ExecutionLedger,
    PatchRecorder,
    PreparedAcceleration,
    RecordedHandle,
    RuntimePolicy,
    family_of,
    refuse_common,
    refuse_module_hooks,
)
from worldfoundry_example_gelu_tanh.kernel import gelu_tanh
from worldfoundry_example_gelu_tanh.options import PLUGIN_NAME, Options

logger = logging.getLogger(__name__)

#: What ``blocks.<i>.ffn.net.0`` must be for the replacement to compute the same function.
_ACTIVATION_CLASS = "GELU"


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Called once by the registry when it discovers this distribution's entry point."""
    register(PLUGIN_NAME, prepare, options=Options)


class GeluTanhHandle(RecordedHandle):
    """Undoes the wrapped forwards; marks each request finished in the ledger when it ends."""

    def end_request(self, request_id: str) -> None:
        self.ledger.finish(request_id)


def _targets(model: nn.Module, opts: Options) -> list[tuple[str, nn.Module]]:
    family = family_of(model, plugin=PLUGIN_NAME)
    if family.name != "wan":
        raise AccelerationRefusedError(PLUGIN_NAME, f"only Wan transformers are supported, got {family.name}")
    blocks = family.blocks(model)
    indices = range(len(blocks)) if opts.blocks is None else opts.blocks
    targets = []
    for index in indices:
        if index >= len(blocks):
            raise AccelerationOptionsError(PLUGIN_NAME, f"block {index} does not exist (the model has {len(blocks)})")
        path, block = blocks[index]
        activation = block.get_submodule("ffn.net.0")
        if type(activation).__name__ != _ACTIVATION_CLASS or getattr(activation, "approximate", None) != "tanh":
            raise AccelerationRefusedError(
                PLUGIN_NAME, f"{path}.ffn.net.0 is {type(activation).__name__}, not a tanh-approximated GELU"
            )
        targets.append((f"{path}.ffn.net.0", activation))
    return targets


def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
    """Validate ``options`` against ``model``; change nothing.

    Raises:
        AccelerationOptionsError: unknown or invalid options, or a block index the model lacks.
        AccelerationRefusedError: not a Wan model, a compiled/training/hooked model, or an unexpected activation.
    """
    opts = Options.from_mapping(options)
    targets = _targets(model, opts)
    refuse_common(model, PLUGIN_NAME)
    refuse_module_hooks(targets, PLUGIN_NAME)
    return PreparedAcceleration(
        name=PLUGIN_NAME,
        claims=frozenset(path for path, _ in targets),
        activate=lambda: activate(targets, opts),
        options=opts.to_json(),
        exact=False,
        notes=("explicit tanh-GELU formula in float32; rounding may differ from PyTorch's fused GELU",),
    )


def activate(targets: list[tuple[str, nn.Module]], opts: Options) -> GeluTanhHandle:
    """Wrap every target's forward. If any wrap fails, the ones already made are undone on leaving the block."""
    ledger = ExecutionLedger(PLUGIN_NAME)
    with PatchRecorder(PLUGIN_NAME) as recorder:
        for path, activation in targets:
            recorder.wrap_forward(activation, _forward_factory(activation, path, ledger, opts), name=PLUGIN_NAME)
        patches = recorder.pop_all()
    logger.debug("%s active on %d module(s)", PLUGIN_NAME, len(targets))
    return GeluTanhHandle(PLUGIN_NAME, patches, ledger)


def _forward_factory(activation: nn.Module, path: str, ledger: ExecutionLedger,
                     opts: Options) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    def make_wrapper(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            proj = activation.proj
            numel = hidden_states.numel() // proj.in_features * proj.out_features
            if numel < opts.min_numel:
                ledger.fallback(path, f"numel {numel} < min_numel {opts.min_numel}")
                return original(hidden_states)
            ledger.executed(path, "kernel")
            return gelu_tanh(proj(hidden_states))

        return forward

    return make_wrapper
