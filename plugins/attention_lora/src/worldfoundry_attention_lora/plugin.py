"""``attention_lora``: entry point and prepare factory (validation only; nothing changes until activation)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import torch
import torch.nn as nn

import worldfoundry
from worldfoundry.base_models.diffusion_model.optimizations.attention_lora_format import (
    AttentionLoraPlan,
    parse_attention_lora,
)
from worldfoundry.plugin import (
    ROLE_ATTENTION_ADAPTER,
    AccelerationRefusedError,
    PreparedAcceleration,
    RuntimePolicy,
    refuse_common,
    refuse_module_hooks,
)
from worldfoundry_attention_lora.handle import activate_attention_lora
from worldfoundry_attention_lora.options import NAME, Options
from worldfoundry_attention_lora.source import AdapterSource, load_adapter_file

#: What every result made with the adapter says about it.
SCOPE: Final = "dit_only"
PRECISION: Final = "fp32"

PrepareFactory = Callable[[nn.Module, Mapping[str, Any], RuntimePolicy], PreparedAcceleration]


def _refuse_model_state(model: nn.Module) -> None:
    refuse_common(model, NAME)
    devices = {p.device for p in model.parameters() if p.device.type == "cuda"}
    if len(devices) > 1:
        raise AccelerationRefusedError(NAME, f"the model is spread over several GPUs ({sorted(map(str, devices))}); "
                                             "the adapter supports a single device")
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, Mapping) and len(set(map(str, device_map.values()))) > 1:
        raise AccelerationRefusedError(NAME, "the model was loaded with a multi-device device_map")
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise AccelerationRefusedError(NAME, "torch.distributed runs with several processes (multi-GPU); "
                                             "the adapter supports one serial process")
    if getattr(model, "peft_config", None):
        raise AccelerationRefusedError(
            NAME, "the model already carries diffusers/PEFT adapters "
                  f"({', '.join(map(str, model.peft_config))}); unload them (unload_lora/delete_adapters) first"
        )


def _refuse_targets(model: nn.Module, plan: AttentionLoraPlan) -> None:
    modules = [(path, model.get_submodule(path)) for path in plan.paths]
    for path, module in modules:
        if type(module) is not nn.Linear:
            raise AccelerationRefusedError(
                NAME, f"{path} is a {type(module).__module__}.{type(module).__name__}, not a plain torch Linear "
                      "(an existing adapter, quantized or replaced layer); load the model without it"
            )
        if "forward" in module.__dict__:
            raise AccelerationRefusedError(NAME, f"{path} already has a patched forward; uninstall what patched it first")
    attentions = sorted({path.rsplit(".to_", 1)[0] for path in plan.paths})
    for path in attentions:
        if getattr(model.get_submodule(path), "fused_projections", False):
            raise AccelerationRefusedError(
                NAME, f"{path} runs fused QKV/KV projections (fuse_qkv_projections); the adapter needs the separate "
                      "to_q/to_k/to_v projections — unfuse them first"
            )
    refuse_module_hooks(modules, NAME)


def adapter_identity(options: Options, source: AdapterSource, plan: AttentionLoraPlan) -> dict[str, Any]:
    """The facts a result made with this adapter must carry (JSON-serialisable)."""
    return {
        "scope": SCOPE,
        "precision": PRECISION,
        "rank": options.rank,
        "scale": options.scale,
        "sha256": source.sha256,
        "identity_kind": source.identity_kind,
        "path": source.path,
        "size_bytes": source.size_bytes,
        "format": plan.format,
        "qkv_layout": plan.qkv_layout,
        "applied_projections": len(plan.projections),
        "validated_only_modules": len(plan.validated_only),
        "tensor_count": plan.tensor_count,
    }


def make_prepare(source: AdapterSource | None = None) -> PrepareFactory:
    """A prepare factory reading the adapter from ``options["path"]`` or, when given, from ``source``.

    Args:
        source: an in-memory adapter (then the options hold ``rank``/``scale`` but no ``path``).

    Returns:
        ``prepare(model, options, policy) -> PreparedAcceleration``.
    """

    def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
        """Validate the options, the model's state and the whole adapter; change nothing.

        Raises:
            AccelerationOptionsError: invalid options or unreadable file.
            AccelerationRefusedError: the model's state excludes the adapter (compiled, multi-GPU/SP, training,
                hooks, fused projections, existing PEFT adapters, unsupported family).
            ArtifactMismatchError: the adapter fails a check; the message names the key.
        """
        opts = Options.from_mapping(options, path_required=source is None)
        _refuse_model_state(model)
        adapter = source if source is not None else load_adapter_file(opts.path or "")
        plan = parse_attention_lora(model, adapter.state, rank=opts.rank, qkv_layout=opts.qkv_layout, plugin=NAME)
        _refuse_targets(model, plan)
        identity = adapter_identity(opts, adapter, plan)
        device = torch.device(policy.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise AccelerationRefusedError(NAME, f"the policy's compute device is {device} but CUDA is not available")
        coverage = f"{len(plan.projections)} projections adapted"
        if plan.validated_only:
            coverage += f"; {len(plan.validated_only)} token-refiner projections validated, not applied"
        identity_note = (f"attention adapter sha256={adapter.sha256} ({adapter.identity_kind}); scope={SCOPE}; "
                         f"precision={PRECISION}; rank={opts.rank}; scale={opts.scale}")
        notes = (
            identity_note,
            coverage,
            "base weights unchanged; adapter computed in FP32 beside each projection",
        )
        receipt_options = {**opts.to_json(), **{k: identity[k] for k in ("sha256", "identity_kind", "scope",
                                                                         "precision", "format")}}
        return PreparedAcceleration(
            name=NAME,
            claims=frozenset(plan.paths) | {ROLE_ATTENTION_ADAPTER},
            activate=lambda: activate_attention_lora(model, plan, opts.scale, device, identity),
            options=receipt_options,
            exact=opts.scale == 0.0,
            notes=notes,
        )

    return prepare


#: The registered factory (reads ``options["path"]``).
prepare_attention_lora: Final = make_prepare()


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    register(NAME, prepare_attention_lora, options=Options)
