"""Entry point of the ``svdquant`` acceleration: artifact binding, prepare-time refusals and activation."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.nn as nn

import worldfoundry
from worldfoundry.base_models.diffusion_model.optimizations.guards import install_weight_view_guard
from worldfoundry.base_models.diffusion_model.optimizations.linear_aliases import translate_patterns
from worldfoundry.base_models.diffusion_model.optimizations.projection_selection import (
    SelectedLinear,
    refuse_shared_parameters,
    select_linears,
)
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.quantization.int4_packing import describe_grouping
from worldfoundry.core.acceleration.quantization.parameter_digest import parameter_digests
from worldfoundry.core.acceleration.quantization.svdquant_artifact import SVDQuantArtifact, load_svdquant_artifact
from worldfoundry.core.acceleration.receipts import ExecutionLedger
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import AccelerationOptionsError, AccelerationRefusedError, ArtifactMismatchError
from worldfoundry.plugin import (
    ROLE_APPROXIMATE_ATTENTION,
    ROLE_FEATURE_CACHE,
    ROLE_OFFLOAD,
    ROLE_QUANTIZATION,
    ROLE_STATIC_KV_CACHE,
    ROLE_WEIGHT_VIEW,
    PreparedAcceleration,
    family_of,
    refuse_common,
    refuse_module_hooks,
)
from worldfoundry.core.acceleration.ffn_structure import FusableFFN, plan_ffn_fusion
from worldfoundry.core.acceleration.ffn_structure import fusion_note as ffn_fusion_note
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import choose_backend
from worldfoundry.core.acceleration.kernels.w4a8_gemm import CHANNEL_ACT_GROUPS
from worldfoundry_svdquant.ffn_fusion import FUSED_KIND, FusedW4F8FFN
from worldfoundry_svdquant.ffn_fusion_w4a8 import FUSED_KIND_W4A8, FusedW4A8FFN
from worldfoundry_svdquant.options import PLUGIN_NAME, Options
from worldfoundry_svdquant.runtime import SVDQuantHandle, SVDQuantRuntime

#: Roles this plugin cannot run beside.
INCOMPATIBLE_ROLES = frozenset({ROLE_FEATURE_CACHE, ROLE_STATIC_KV_CACHE, ROLE_OFFLOAD, ROLE_APPROXIMATE_ATTENTION})


def _family(model: nn.Module) -> str | None:
    try:
        return family_of(model, plugin=PLUGIN_NAME).name
    except AccelerationRefusedError:
        return None


def select_from_artifact(model: nn.Module, artifact: SVDQuantArtifact,
                         include: Sequence[str] | None) -> list[SelectedLinear]:
    """The Linears to replace: the artifact's (all, or those ``include`` selects), checked against the model.

    Raises:
        AccelerationRefusedError: a path of the artifact is not a plain Linear of the model, ``include``
            selects a Linear the artifact has no entry for, or the selection is empty.
    """
    names = dict(model.named_modules())
    missing = [p for p in artifact.linears if not isinstance(names.get(p), nn.Linear)]
    if missing:
        raise AccelerationRefusedError(
            PLUGIN_NAME,
            f"{artifact.file} was calibrated for Linears this model does not have: {', '.join(missing[:4])}"
            "; calibrate again for this model")
    if include is None:
        return select_linears(model, list(artifact.linears), plugin=PLUGIN_NAME)
    patterns = translate_patterns(model, include, family=_family(model))
    selected = select_linears(model, patterns, plugin=PLUGIN_NAME)
    absent = [s.path for s in selected if s.path not in artifact.linears]
    if absent:
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"include selects Linears {artifact.file} has no entry for: {', '.join(absent[:4])}; "
            "narrow include or calibrate them (worldfoundry calibrate svdquant --include ...)")
    return selected


def verify_sources(artifact: SVDQuantArtifact, selected: Sequence[SelectedLinear]) -> None:
    """Compare every selected Linear's shape and parameter SHA256 with the artifact (digests cached per
    parameter version).

    Raises:
        ArtifactMismatchError: other shapes, bias presence or weights, naming the Linear and the parameter.
    """
    params, labels = [], []
    for s in selected:
        entry = artifact.linears[s.path]
        if (entry.in_features, entry.out_features) != (s.module.in_features, s.module.out_features):
            raise ArtifactMismatchError(
                f"{artifact.file}: {s.path} is {s.module.in_features}->{s.module.out_features} in the model, "
                f"{entry.in_features}->{entry.out_features} in the artifact; calibrate again for this model")
        if (entry.source.get("bias") is None) != (s.module.bias is None):
            raise ArtifactMismatchError(f"{artifact.file}: {s.path} bias presence differs from the artifact's")
        for pname in ("weight", "bias"):
            tensor = getattr(s.module, pname)
            if tensor is not None:
                params.append(tensor)
                labels.append((s.path, pname, entry.source[pname]["sha256"]))
    for (path, pname, recorded), digest in zip(labels, parameter_digests(params), strict=True):
        if digest != recorded:
            raise ArtifactMismatchError(
                f"{artifact.file} was calibrated on {path}.{pname} SHA256 {recorded[:16]}..., the model has "
                f"{digest[:16]}... (other weights or dtype); calibrate again for these weights "
                "(worldfoundry calibrate svdquant)")


def _refuse_gradient_checkpointing(model: nn.Module) -> None:
    flagged = [name or "<root>" for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", False)]
    if flagged:
        raise AccelerationRefusedError(
            PLUGIN_NAME, f"gradient checkpointing is enabled on {', '.join(flagged[:4])}; disable it for inference")


def _check_activation_group(opts: Options, artifact: SVDQuantArtifact) -> None:
    """``activation_group`` fits the artifact: W4A8 needs group-wise weights of that group size, the reference
    groupings that nest and divide every selected Linear's input features."""
    group = opts.activation_group
    if group is None:
        return
    weight_group = int(artifact.manifest["group_size"])
    takes = group in CHANNEL_ACT_GROUPS if weight_group == 0 else weight_group == group
    if opts.backend == "w4a8" and not takes:
        raise AccelerationOptionsError(
            PLUGIN_NAME, f"activation_group: backend w4a8 takes activation groups equal to a group-wise artifact's "
            f"weight groups, or of 128 or 256 with a per-channel artifact ({artifact.file}: "
            f"{describe_grouping(weight_group)}); choose one of those, or backend: reference",
            path=f"accelerations.{PLUGIN_NAME}.activation_group")
    for path, entry in artifact.linears.items():
        k = int(entry.in_features)
        if k % group or (weight_group and max(group, weight_group) % min(group, weight_group)):
            raise AccelerationOptionsError(
                PLUGIN_NAME, f"activation_group: {path} has {k} input features and weight groups of "
                f"{weight_group or k}: activation groups of {group} must divide the features and nest with the "
                "weight groups; choose another activation_group", path=f"accelerations.{PLUGIN_NAME}.activation_group")


def _artifact_summary(artifact: SVDQuantArtifact) -> dict[str, Any]:
    m = artifact.manifest
    return {"file": artifact.file, "format": m["format"], "method": m["method"], "rank": m["rank"],
            "group_size": m["group_size"], "scale_grouping": describe_grouping(int(m["group_size"])),
            "alpha": m.get("alpha"), "include": list(m.get("include", [])),
            "calibration_seeds": list((m.get("calibration") or {}).get("seeds", [])),
            "kept_dense": list(((m.get("calibration") or {}).get("sensitivity") or {}).get("kept_dense_linears", []))}


def _activate(model: nn.Module, opts: Options, artifact: SVDQuantArtifact, selected: Sequence[SelectedLinear],
              summary: dict[str, Any], fused: Sequence[FusableFFN]) -> SVDQuantHandle:
    """Bind the artifact's weights, move dense weights to the host if asked, guard and wrap (all recorded)."""
    ledger = ExecutionLedger(PLUGIN_NAME)
    runtime = SVDQuantRuntime(opts, ledger)
    # chosen on the model's device, before keep_original: cpu moves the dense weights to the host
    fusion = FusedW4A8FFN if _fused_backend(opts, artifact, selected) == "w4a8" else FusedW4F8FFN
    with PatchRecorder(PLUGIN_NAME) as rec:
        for s in selected:
            runtime.add(s.path, s.module, artifact.weight(s.path, s.module.weight.device))
        if opts.keep_original == "cpu":
            for s in selected:
                runtime.move_dense_to_host(rec, s.path)
        runtime.guard = install_weight_view_guard(rec, model, {s.path: s.module for s in selected},
                                                  plugin=PLUGIN_NAME)
        for s in selected:
            rec.wrap_forward(s.module, runtime.make_wrapper(s.path), name=PLUGIN_NAME)
        for plan in fused:
            rec.wrap_forward(plan.ffn, fusion(runtime, plan).make_wrapper, name=PLUGIN_NAME)
        patches = rec.pop_all()
    return SVDQuantHandle(patches, ledger, runtime, summary)


def _fused_backend(opts: Options, artifact: SVDQuantArtifact, selected: Sequence[SelectedLinear]) -> str | None:
    """The backend the selected Linears run on their device, or ``None`` without any."""
    if not selected:
        return None
    device = selected[0].module.weight.device
    return choose_backend(device, opts.backend, int(artifact.manifest["group_size"])).backend


def plan_fusion(model: nn.Module, opts: Options, artifact: SVDQuantArtifact,
                selected: Sequence[SelectedLinear]) -> tuple[list[FusableFFN], dict[str, str]]:
    """The FFNs whose GELU producer runs fused: both Linears selected, structure reproducible, and W4F8 or W4A8
    the backend on their device (a weight the W4F8 preparation later refuses, or an input the W4A8 producer does
    not take, runs unfused, per call)."""
    if _fused_backend(opts, artifact, selected) not in ("w4f8", "w4a8") or opts.activation_group is not None:
        return [], {}
    return plan_ffn_fusion(model, [s.path for s in selected], enabled=opts.fuse_gelu)


def prepare(model: nn.Module, options: Mapping[str, Any], policy: RuntimePolicy) -> PreparedAcceleration:
    """Validate options, read the artifact and bind it to the model (nothing is changed).

    Args:
        model: a diffusers DiT (or any module whose Linear paths the artifact names).
        options: ``{"artifact", "include", "keep_original", "backend", "fast_accum", "fuse_gelu",
            "one_launch_operand"}``.
        policy: the runtime policy (unused: the plugin runs on the model's own device).

    Returns:
        A plan claiming every selected Linear, ``role:quantization`` and ``role:weight_view``.

    Raises:
        AccelerationOptionsError: unknown option or bad value.
        ArtifactFormatError: the artifact is missing or malformed (names the file and field).
        ArtifactMismatchError: the artifact was calibrated on other weights or shapes.
        AccelerationRefusedError: Linears missing or not plain, shared parameters, hooks on a selected Linear,
            gradient checkpointing, training mode, torch.compile, CUDA graphs, sequence parallelism, diffusers hooks.
    """
    opts = Options.from_mapping(options)
    refuse_common(model, PLUGIN_NAME)
    _refuse_gradient_checkpointing(model)
    artifact = load_svdquant_artifact(opts.artifact)
    selected = select_from_artifact(model, artifact, opts.include)
    refuse_shared_parameters(model, selected, plugin=PLUGIN_NAME)
    refuse_module_hooks([(s.path, s.module) for s in selected], PLUGIN_NAME)
    verify_sources(artifact, selected)
    _check_activation_group(opts, artifact)
    summary = _artifact_summary(artifact)
    fused, not_fused = plan_fusion(model, opts, artifact, selected)

    def activate() -> SVDQuantHandle:
        return _activate(model, opts, artifact, selected, summary, fused)

    resolved = opts.to_json()
    resolved["modules"] = len(selected)
    return PreparedAcceleration(
        name=PLUGIN_NAME,
        claims=frozenset({s.path for s in selected} | {p.claim for p in fused} | {ROLE_QUANTIZATION,
                                                                                  ROLE_WEIGHT_VIEW}),
        activate=activate,
        incompatible_with=INCOMPATIBLE_ROLES,
        options=resolved,
        exact=False,
        notes=(
            f"approximate: {artifact.manifest['method']} rank {artifact.manifest['rank']} low-rank + INT4 residual "
            f"({describe_grouping(int(artifact.manifest['group_size']))}) with per-token FP8 (w4f8) or INT8 (w4a8) "
            f"activations, from {artifact.file}",
            "keep_original cpu: dense weights move to pinned host memory (device weight memory drops); device: "
            "dense weights stay and the quantized tensors are added",
            ffn_fusion_note(fused, not_fused, FUSED_KIND_W4A8 if _fused_backend(opts, artifact, selected) == "w4a8"
                            else FUSED_KIND) if fused or not_fused else
            "GELU producer fusion: only with the W4F8 or W4A8 backend and both Linears of an FFN selected",
            "runs W4F8 (per-channel artifacts: FP8 activations and codes, one torch._scaled_mm with the low-rank "
            "branch as FP8 head/tail codes) or W4A8 (group-wise: Triton, INT8 tensor cores) on sm_90+, W4A16 on "
            "other CUDA GPUs and the torch reference of the W4A8 numerics on the CPU; receipts name the backend "
            "of every call",
        ),
    )


prepare.options_class = Options  # lets tools validate options without a model (worldfoundry bench)


@worldfoundry.hookimpl
def register_diffusion_accelerations(register: Callable[..., None]) -> None:
    """Register ``svdquant``."""
    register(PLUGIN_NAME, prepare, options=Options)
