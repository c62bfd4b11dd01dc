"""Activation of ``attention_lora``: wrap the adapted projections' forwards and report what ran."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from worldfoundry.base_models.diffusion_model.optimizations.attention_lora_format import (
    AttentionLoraPlan,
)
from worldfoundry.base_models.diffusion_model.optimizations.guards import install_call_refusals
from worldfoundry.core.acceleration.lora import (
    LoraKernelStats,
    LoraProjection,
    SharedDownProjection,
    stack_down_groups,
)
from worldfoundry.plugin import ExecutionLedger, PatchRecorder, RecordedHandle
from worldfoundry_attention_lora.options import NAME

logger = logging.getLogger(__name__)

#: Patch name on every wrapped projection forward.
PATCH_NAME = "attention_lora"
#: Ledger ``executed`` kinds.
KIND_ADAPTER = "fp32_adapter"
KIND_SCALE_ZERO = "scale_zero_identity"


class _LedgerStats(LoraKernelStats):
    """Kernel statistics that also count per request in the plugin's ledger."""

    def __init__(self, ledger: ExecutionLedger) -> None:
        super().__init__()
        self._ledger = ledger

    def record(self, impl: str, reason: str | None) -> None:
        super().record(impl, reason)
        self._ledger.count(f"kernel_{impl}")
        if reason is not None:
            self._ledger.count(f"reference_fallback:{reason}")

    def record_share(self, event: str, n: int = 1) -> None:
        super().record_share(event, n)
        self._ledger.count(f"shared_down:{event}", n)


class AttentionLoraHandle(RecordedHandle):
    """The active adapter. ``deactivate()`` restores the original forwards and frees the device copies."""

    def __init__(self, patches: PatchRecorder, ledger: ExecutionLedger, stats: LoraKernelStats,
                 identity: Mapping[str, Any], downs: list[SharedDownProjection],
                 projections: dict[str, LoraProjection]) -> None:
        super().__init__(NAME, patches, ledger)
        self.stats = stats
        self.identity = dict(identity)
        self._downs = downs
        self._projections = projections

    @property
    def adapted_paths(self) -> tuple[str, ...]:
        return tuple(self._projections)

    def adapter_bytes(self) -> int:
        """Bytes of adapter tensors held on the compute device (A, its bf16 split, B)."""
        total = 0
        for down in self._downs:
            a, a3 = down.weights_on(down.device)
            total += a.numel() * a.element_size() + a3.numel() * a3.element_size()
        for proj in self._projections.values():
            b = proj.b_on(proj.down.device)
            total += b.numel() * b.element_size()
        return total

    def begin_request(self, request_id: str) -> None:
        self.ledger.note("attention_adapter", dict(self.identity), request_id=request_id)

    def end_request(self, request_id: str) -> None:
        for down in self._downs:
            down.clear_cache()
        self.ledger.finish(request_id)

    def release(self) -> None:
        for down in self._downs:
            down.release()
        for proj in self._projections.values():
            proj.release()
        self._downs = []
        self._projections = {}

    def execution_report(self) -> dict[str, Any]:
        report = super().execution_report()
        report["attention_adapter"] = dict(self.identity)
        report["kernels"] = self.stats.to_json()
        report["adapter_device_copies"] = sum(d.device_copies for d in self._downs)
        report["adapter_device_bytes"] = self.adapter_bytes()
        return report


def _wrapper(path: str, projection: LoraProjection, ledger: ExecutionLedger,
             stats: LoraKernelStats) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    scale_is_zero = projection.scale == 0.0

    def make(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def forward(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            base = original(input, *args, **kwargs)
            if scale_is_zero:
                ledger.executed(path, KIND_SCALE_ZERO)
                return base
            out = projection.apply(input, base, stats)
            ledger.executed(path, KIND_ADAPTER)
            return out

        return forward

    return make


#: Why diffusers' projection fusion cannot run beside the adapter.
FUSION_REASON = ("the fused to_qkv / to_kv projection bypasses the adapted to_q/to_k/to_v, which would silently "
                 "drop the adapter")


def _refuse_projection_fusion(recorder: PatchRecorder, model: nn.Module, adapted: Mapping[str, Any]) -> None:
    """``model.fuse_qkv_projections()`` and each adapted attention's ``fuse_projections()`` refuse while active."""
    install_call_refusals(recorder, model, {"fuse_qkv_projections": FUSION_REASON}, plugin=NAME)
    attentions = sorted({path.rsplit(".", 1)[0] for path in adapted})
    for path in attentions:
        try:
            attention = model.get_submodule(path)
        except AttributeError:
            continue
        install_call_refusals(recorder, attention, {"fuse_projections": FUSION_REASON}, plugin=NAME,
                              where=f"module {path!r}")


def activate_attention_lora(model: nn.Module, plan: AttentionLoraPlan, scale: float, device: torch.device,
                            identity: Mapping[str, Any]) -> AttentionLoraHandle:
    """Copy the adapter to ``device`` and wrap every adapted projection's forward (recorded, reversible).

    Args:
        model: the transformer the plan was validated against.
        plan: the validated adapter.
        scale: effective scale.
        device: the compute device (where activations are when the projections run).
        identity: scope/precision/rank/scale/SHA256 facts carried by every request's report.

    Returns:
        The :class:`AttentionLoraHandle`.
    """
    ledger = ExecutionLedger(NAME)
    stats = _LedgerStats(ledger)
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for proj in plan.projections:
        groups.setdefault(proj.input_group, []).append((proj.path, proj.a))
    b_by_path = {proj.path: proj.b for proj in plan.projections}
    downs: list[SharedDownProjection] = []
    projections: dict[str, LoraProjection] = {}
    for members in groups.values():
        for stacked, offsets in stack_down_groups(members):
            down = SharedDownProjection(stacked, device=device)
            downs.append(down)
            for path, offset in offsets.items():
                projections[path] = LoraProjection(down, offset, b_by_path[path], scale, device)
    ordered = {proj.path: projections[proj.path] for proj in plan.projections}
    with PatchRecorder(NAME) as recorder:
        for path, projection in ordered.items():
            recorder.wrap_forward(model.get_submodule(path), _wrapper(path, projection, ledger, stats), name=PATCH_NAME)
        _refuse_projection_fusion(recorder, model, ordered)
        patches = recorder.pop_all()
    logger.info("attention_lora: %d projections adapted (rank %d, scale %s) on %s",
                len(ordered), plan.rank, scale, device)
    return AttentionLoraHandle(patches, ledger, stats, identity, downs, ordered)
