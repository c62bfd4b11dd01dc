"""Glue: registration, ``prepare`` (validation only) and ``activate`` of ``cuda_graph``.

``prepare`` refuses what a captured forward cannot honour (a compiled model, an outer capture or an already captured
model, sequence parallelism, diffusers hooks, training mode) and declares the named conflicts: ``resident_blocks``
and anything holding ``role:offload`` (they need host control between blocks of every call), and, with
``output="static"``, ``role:feature_cache`` (a cache would keep the graph's own buffers). It claims the role
``role:cuda_graph`` only — no module path — so a plugin that wraps the model's forward outside it (``easycache``:
skipped steps never reach the graph) can be installed beside it. ``activate`` wraps ``model.forward``.

The capture backend is injectable (:func:`make_prepare`): the registered factory uses CUDA graphs (and runs
eagerly, with the reason ``"no CUDA device"``, where there is none); tests pass a
:class:`~worldfoundry.core.acceleration.cuda_graph.EagerReplayBackend`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import torch.nn as nn

import worldfoundry
from worldfoundry.base_models.diffusion_model.optimizations.refusals import CUDA_GRAPH_MARKER
from worldfoundry.core.acceleration.cuda_graph import CudaGraphBackend, GraphBackend, GraphRunner
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.plugin import (
    ROLE_FEATURE_CACHE,
    ROLE_OFFLOAD,
    ExecutionLedger,
    PreparedAcceleration,
    refuse_common,
    role,
)
from worldfoundry_cuda_graph.handle import CudaGraphHandle, install
from worldfoundry_cuda_graph.options import PLUGIN_NAME, Options

#: The role this plugin claims (one CUDA-graph capture of a model at a time).
ROLE_CUDA_GRAPH: Final = role("cuda_graph")
#: Plugins whose forward patches have no per-call Python state beyond ledger calls (or run outside the graph).
GRAPH_SAFE_PLUGINS: Final = frozenset({
    "optimized_mha", "selective_fp8", "block_fusion", "wan_block_fusion", "sana_block_fusion", "easycache"})
#: Plugins that need host control inside every call.
REFUSED_PLUGINS: Final = frozenset({"resident_blocks", ROLE_OFFLOAD})


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Called once by the registry when it discovers this distribution's entry point."""
    register(PLUGIN_NAME, prepare, options=Options)


def make_prepare(backend_factory: Callable[[], GraphBackend] | None = None) -> Callable[..., PreparedAcceleration]:
    """A prepare factory whose activations capture with ``backend_factory()`` (default: CUDA graphs).

    Example:
        >>> from worldfoundry.core.acceleration.cuda_graph import EagerReplayBackend
        >>> factory = make_prepare(EagerReplayBackend)
        >>> callable(factory)
        True
    """
    factory = backend_factory or CudaGraphBackend

    def prepare_with_backend(model: nn.Module, options: Mapping[str, Any],
                             policy: RuntimePolicy | None = None) -> PreparedAcceleration:
        return _prepare(model, options, factory)

    prepare_with_backend.options_class = Options  # type: ignore[attr-defined]
    return prepare_with_backend


def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy | None = None) -> PreparedAcceleration:
    """Validate ``options`` against ``model``; change nothing.

    Raises:
        AccelerationOptionsError: unknown or invalid options.
        AccelerationRefusedError: compiled model, CUDA-graph capture in progress or the model already captured,
            sequence parallelism, diffusers hooks, training mode.
    """
    return _prepare(model, options, CudaGraphBackend)


def _prepare(model: nn.Module, options: Mapping[str, Any],
             backend_factory: Callable[[], GraphBackend]) -> PreparedAcceleration:
    opts = Options.from_mapping(options)
    refuse_common(model, PLUGIN_NAME)
    incompatible = set(REFUSED_PLUGINS)
    if opts.output == "static":
        incompatible.add(ROLE_FEATURE_CACHE)
    return PreparedAcceleration(
        name=PLUGIN_NAME,
        claims=frozenset({ROLE_CUDA_GRAPH}),
        activate=lambda: activate(model, opts, backend_factory()),
        incompatible_with=frozenset(incompatible),
        options=opts.to_json(),
        exact=True,
        notes=(
            f"one graph per call signature (shapes, strides, dtypes, alignment, plugin set), at most "
            f"{opts.max_signatures}, each with a private memory pool (pool bytes in the execution report)",
            "replays are the captured eager forward: bitwise equal; any parameter, buffer, hook or module change "
            "drops every graph",
            "outputs are copied out (callers own them)" if opts.output == "copy" else
            "outputs are the graph's static buffers, overwritten by the next call of the same signature",
        ),
    )


def activate(model: nn.Module, opts: Options, backend: GraphBackend) -> CudaGraphHandle:
    """Wrap ``model.forward`` with a :class:`GraphRunner` (recorded; undone on failure part-way)."""
    ledger = ExecutionLedger(PLUGIN_NAME)
    runner = GraphRunner(model, PLUGIN_NAME, ledger, backend, max_signatures=opts.max_signatures,
                         output=opts.output, warmup_calls=opts.warmup_calls,
                         safe_names=GRAPH_SAFE_PLUGINS | frozenset(opts.compose_with))
    return CudaGraphHandle(install(model, runner, CUDA_GRAPH_MARKER), ledger, runner)


prepare.options_class = Options  # type: ignore[attr-defined]  # lets tools validate options without a model

__all__ = ["GRAPH_SAFE_PLUGINS", "REFUSED_PLUGINS", "ROLE_CUDA_GRAPH", "activate", "make_prepare", "prepare"]
