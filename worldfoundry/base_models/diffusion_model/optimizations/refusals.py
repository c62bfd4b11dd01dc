"""Shared prepare-time refusals: states of a model that most accelerations cannot compose with.

Each check raises :class:`~worldfoundry.errors.AccelerationRefusedError` naming the plugin and the thing found.
Call them from a prepare factory (they only read the model).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from worldfoundry.errors import AccelerationRefusedError

#: Marker attribute set on a model whose forward is captured in a CUDA graph (the ``cuda_graph`` plugin sets it while
#: installed; plugins installed beside it in the same session prepare before it is set).
CUDA_GRAPH_MARKER = "_worldfoundry_cuda_graph"


def compiled_modules(model: nn.Module) -> list[str]:
    """Paths of modules compiled with ``torch.compile`` (whole model or regional ``module.compile()``)."""
    found = []
    if type(model).__name__ == "OptimizedModule" or hasattr(model, "_orig_mod"):
        found.append("<root>")
    for name, module in model.named_modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            found.append(name or "<root>")
    return found


def refuse_compiled(model: nn.Module, plugin: str) -> None:
    found = compiled_modules(model)
    if found:
        raise AccelerationRefusedError(
            plugin, f"the model is compiled with torch.compile ({', '.join(found[:4])}); load it again uncompiled"
        )


def refuse_cuda_graphs(model: nn.Module, plugin: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise AccelerationRefusedError(plugin, "a CUDA graph capture is in progress")
    if getattr(model, CUDA_GRAPH_MARKER, None):
        raise AccelerationRefusedError(plugin, "the model's forward is captured in a CUDA graph; rebuild it uncaptured")


def refuse_sequence_parallel(model: nn.Module, plugin: str) -> None:
    if getattr(model, "_parallel_config", None) is not None:
        raise AccelerationRefusedError(plugin, "sequence/context parallelism is enabled on the model")
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is not None and getattr(processor, "_parallel_config", None) is not None:
            raise AccelerationRefusedError(plugin, f"context parallelism is enabled on {name}")


def diffusers_hooks(model: nn.Module) -> list[str]:
    """Modules carrying diffusers hooks (cache hooks, group offloading, layerwise casting)."""
    found = []
    for name, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None and getattr(registry, "hooks", None):
            found.append(f"{name or '<root>'} ({', '.join(registry.hooks)})")
    return found


def refuse_diffusers_hooks(model: nn.Module, plugin: str) -> None:
    found = diffusers_hooks(model)
    if found:
        raise AccelerationRefusedError(
            plugin, f"diffusers hooks are attached (cache/offload/casting): {', '.join(found[:4])}; remove them first"
        )


def accelerate_hooks(model: nn.Module) -> list[str]:
    """Modules carrying an accelerate hook (``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``,
    ``device_map`` dispatch): ``module._hf_hook``."""
    return [name or "<root>" for name, module in model.named_modules() if "_hf_hook" in module.__dict__]


def refuse_accelerate_hooks(model: nn.Module, plugin: str) -> None:
    """For plugins that own where weights live: accelerate's offload hooks would move them behind its back."""
    found = accelerate_hooks(model)
    if found:
        raise AccelerationRefusedError(
            plugin, f"accelerate offload hooks are attached ({', '.join(found[:4])}; enable_model_cpu_offload / "
            "device_map); remove them first (pipe.remove_all_hooks(), or load without offloading)"
        )


def refuse_training(model: nn.Module, plugin: str) -> None:
    if model.training:
        raise AccelerationRefusedError(plugin, "the model is in training mode; call model.eval() first")
    if getattr(model, "gradient_checkpointing", False):
        raise AccelerationRefusedError(plugin, "gradient checkpointing is enabled; disable it for inference")


def refuse_module_hooks(modules: Iterable[tuple[str, nn.Module]], plugin: str) -> None:
    """Refuse when any of ``modules`` has its own forward (pre-)hooks, which a replaced forward would skip."""
    for name, module in modules:
        if module._forward_hooks or module._forward_pre_hooks:
            raise AccelerationRefusedError(plugin, f"{name} has forward hooks that the accelerated path would bypass")


def refuse_common(model: nn.Module, plugin: str, *, allow_training: bool = False) -> None:
    """Compile, CUDA graphs, sequence parallelism, diffusers hooks and (unless allowed) training mode."""
    refuse_compiled(model, plugin)
    refuse_cuda_graphs(model, plugin)
    refuse_sequence_parallel(model, plugin)
    refuse_diffusers_hooks(model, plugin)
    if not allow_training:
        refuse_training(model, plugin)
