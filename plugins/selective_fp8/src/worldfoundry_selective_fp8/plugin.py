"""Entry point of the ``selective_fp8`` acceleration: option parsing, prepare-time refusals and activation."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

import worldfoundry
from worldfoundry.base_models.diffusion_model.optimizations.guards import install_weight_view_guard
from worldfoundry.base_models.diffusion_model.optimizations.projection_selection import (
    SelectedLinear,
    linear_name_patterns,
    refuse_misaligned,
    refuse_shared_parameters,
    select_linears,
)
from worldfoundry.core.acceleration.quantization.fp8_linear import SCALED_MM_ALIGNMENT, quantize_weight_rowwise_fp8
from worldfoundry.plugin import (
    ROLE_APPROXIMATE_ATTENTION,
    ROLE_FEATURE_CACHE,
    ROLE_OFFLOAD,
    ROLE_QUANTIZATION,
    ROLE_STATIC_KV_CACHE,
    ROLE_WEIGHT_VIEW,
    AccelerationRefusedError,
    ExecutionLedger,
    PatchRecorder,
    PreparedAcceleration,
    RuntimePolicy,
    family_of,
    refuse_common,
    refuse_module_hooks,
)
from worldfoundry.core.acceleration.ffn_structure import fusion_note as ffn_fusion_note
from worldfoundry_selective_fp8.ffn_fusion import FUSED_KIND, FusableFFN, FusedFFN, plan_ffn_fusion
from worldfoundry_selective_fp8.options import PLUGIN_NAME, Options
from worldfoundry_selective_fp8.runtime import SelectiveFP8Handle, SelectiveFP8Runtime

#: Roles this plugin cannot run beside.
INCOMPATIBLE_ROLES = frozenset({ROLE_FEATURE_CACHE, ROLE_STATIC_KV_CACHE, ROLE_OFFLOAD, ROLE_APPROXIMATE_ATTENTION})
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def default_include(model: nn.Module) -> tuple[str, ...]:
    """The family's FFN Linear patterns (``blocks.*.ffn.net.0.proj`` ... for Wan).

    Raises:
        AccelerationRefusedError: the model is not a supported family, or its family has no Linear FFN
            (SANA-Video): the message lists the Linear names that exist.
    """
    family = family_of(model, plugin=PLUGIN_NAME)
    if not family.ffn_linear_names:
        raise AccelerationRefusedError(
            PLUGIN_NAME,
            f"the {family.name} family has no Linear FFN (its FFN is convolutional); pass an explicit 'include' "
            f"list. Linear names in this model: {', '.join(linear_name_patterns(model)[:24])}",
        )
    return tuple(f"{family.blocks_attribute}.*.{rel}" for rel in family.ffn_linear_names)


def _refuse_gradient_checkpointing(model: nn.Module) -> None:
    flagged = [name or "<root>" for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", False)]
    if flagged:
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"gradient checkpointing is enabled on {', '.join(flagged[:4])}; disable it for inference"
        )


def _refuse_weight_dtypes(selected: Sequence[SelectedLinear]) -> None:
    odd = [f"{s.path} ({s.module.weight.dtype})" for s in selected if s.module.weight.dtype not in _WEIGHT_DTYPES]
    if odd:
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"weights must be bfloat16, float16 or float32 (already quantized?): {', '.join(odd[:4])}"
        )


def memory_note(selected: Sequence[SelectedLinear]) -> str:
    """One honest sentence about the memory this activation adds."""
    extra = sum(s.module.in_features * s.module.out_features + 4 * s.module.out_features for s in selected)
    return (
        f"keeps the dense weights for exact undo and adds {extra / 2**20:.1f} MiB of FP8 weights and scales for "
        f"{len(selected)} Linear(s); it speeds compute, it does not save memory"
    )


def fusion_note(fused: Sequence[FusableFFN], not_fused: Mapping[str, str]) -> str:
    """One sentence about the fused GELU producers (and the candidate FFNs left unfused, with why)."""
    return ffn_fusion_note(fused, not_fused, FUSED_KIND)


def _select(model: nn.Module, include: Sequence[str], exclude: Sequence[str]) -> list[SelectedLinear]:
    """The Linears ``include``/``exclude`` select, refused unless ``torch._scaled_mm`` can take all of them."""
    selected = select_linears(model, include, exclude, plugin=PLUGIN_NAME)
    refuse_shared_parameters(model, selected, plugin=PLUGIN_NAME)
    refuse_module_hooks([(s.path, s.module) for s in selected], PLUGIN_NAME)
    refuse_misaligned(
        selected, SCALED_MM_ALIGNMENT, plugin=PLUGIN_NAME,
        why="torch._scaled_mm needs in_features and out_features divisible by 16",
    )
    _refuse_weight_dtypes(selected)
    return selected


def _activate(model: nn.Module, opts: Options, selected: Sequence[SelectedLinear], fused: Sequence[FusableFFN],
              not_fused: Mapping[str, str]) -> SelectiveFP8Handle:
    """Quantize the selected weights and wrap their forwards (and the fused FFNs'), every change recorded."""
    ledger = ExecutionLedger(PLUGIN_NAME)
    with PatchRecorder(PLUGIN_NAME) as rec:
        guard = install_weight_view_guard(rec, model, {s.path: s.module for s in selected}, plugin=PLUGIN_NAME)
        runtime = SelectiveFP8Runtime(opts, ledger, guard)
        for s in selected:
            runtime.add(s.path, s.module, quantize_weight_rowwise_fp8(s.module.weight))
            rec.wrap_forward(s.module, runtime.make_wrapper(s.path), name=PLUGIN_NAME)
        for plan in fused:
            rec.wrap_forward(plan.ffn, FusedFFN(runtime, plan).make_wrapper, name=PLUGIN_NAME)
        runtime.fused_ffns = tuple(plan.claim for plan in fused)
        runtime.not_fused = dict(not_fused)
        patches = rec.pop_all()
    return SelectiveFP8Handle(patches, ledger, runtime)


def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
    """Validate options and model; return the plan (the model is not changed).

    Args:
        model: a diffusers DiT (Wan, SANA-Video, MiniMax-H3) or any module when ``include`` is given.
        options: ``{"include", "exclude", "scaling", "use_fast_accum", "min_tokens", "fuse_gelu"}`` (all
            optional).
        policy: the runtime policy (unused: the plugin runs on the model's own device; bf16 inputs on
            FP8-capable CUDA devices use FP8, everything else runs dense and is recorded).

    Returns:
        A plan claiming every selected Linear path, every FFN whose GELU producer is fused (its forward is
        replaced) plus ``role:quantization`` and ``role:weight_view``.

    Raises:
        AccelerationOptionsError: unknown option or invalid value.
        AccelerationRefusedError: empty selection (with near matches), Linear subclass or replaced forward,
            shared parameter storage, forward hooks on a selected Linear, gradient checkpointing, dimensions
            not divisible by 16, unsupported weight dtype, training mode, torch.compile, CUDA graphs,
            sequence parallelism or diffusers hooks.
    """
    opts = Options.from_mapping(options)
    refuse_common(model, PLUGIN_NAME)
    _refuse_gradient_checkpointing(model)
    include = opts.include if opts.include is not None else default_include(model)
    selected = _select(model, include, opts.exclude)
    fused, not_fused = plan_ffn_fusion(model, [s.path for s in selected], enabled=opts.fuse_gelu)

    def activate() -> SelectiveFP8Handle:
        return _activate(model, opts, selected, fused, not_fused)

    resolved = opts.to_json()
    resolved["include"] = list(include)
    return PreparedAcceleration(
        name=PLUGIN_NAME,
        claims=frozenset({s.path for s in selected} | {plan.claim for plan in fused}
                         | {ROLE_QUANTIZATION, ROLE_WEIGHT_VIEW}),
        activate=activate,
        incompatible_with=INCOMPATIBLE_ROLES,
        options=resolved,
        exact=False,
        notes=(
            "approximate: rowwise FP8 e4m3 weights and activations, float32 accumulation, bfloat16 output",
            memory_note(selected),
            fusion_note(fused, not_fused),
            "runs the dense Linear (recorded as a fallback with its reason) on CPU, GPUs below sm_89, non-bf16 "
            f"inputs and inputs with fewer than {opts.min_tokens} rows",
        ),
    )


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Register ``selective_fp8``."""
    register(PLUGIN_NAME, prepare, options=Options)
