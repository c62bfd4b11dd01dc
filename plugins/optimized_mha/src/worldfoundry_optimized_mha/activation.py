"""``activate`` of ``optimized_mha`` and its handle: pack, install the chosen projection path, count, undo.

Everything is recorded with a :class:`PatchRecorder`; uninstall removes the fused-branch attributes, restores
``fused_projections``, unwraps the forwards and gives every packed Parameter a separate storage again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worldfoundry.base_models.diffusion_model.optimizations.attention_sites import (
    NATIVE_DIFFUSERS_BACKEND,
    ProjectionGroup,
    diffusers_attention_backend,
)
from worldfoundry.core.acceleration.cuda_graph.participants import GraphCall
from worldfoundry.base_models.diffusion_model.optimizations.guards import install_call_refusals
from worldfoundry.core.attention.fused_projection import (
    ProjectionResult,
    SharedInputProjection,
)
from worldfoundry.core.attention.packed_projection import (
    CHECKS,
    DENSE_PREFIX,
    FUSED,
    MISMATCHES,
    ForwardValidation,
    PackedProjection,
)
from worldfoundry.core.attention.packed_storage import PackedLinearParameters
from worldfoundry.core.attention.sdpa_backends import sdpa_backend_scope
from worldfoundry.plugin import AttentionBackendError, ExecutionLedger, PatchRecorder, RecordedHandle
from worldfoundry_optimized_mha.options import PLUGIN_NAME
from worldfoundry_optimized_mha.plan import (
    FUSED_BRANCH,
    PROJECTION_WRAPPERS,
    SitePlan,
    path_summary,
)

logger = logging.getLogger(__name__)


@dataclass
class FusedBranchGroup:
    """One group served through the processor's fused branch; its counts are folded into the ledger on report."""

    paths: tuple[str, ...]
    kind: str
    projection: PackedProjection

    def fold_into(self, ledger: ExecutionLedger) -> None:
        for (rid, event), n in self.projection.drain().items():
            if event == FUSED:
                for path in self.paths:
                    ledger.executed(path, self.kind, n, request_id=rid)
            elif event == CHECKS:
                ledger.count("bitwise_checks", n, request_id=rid)
            elif event == MISMATCHES:
                ledger.count("bitwise_mismatches", n, request_id=rid)
            elif event.startswith(DENSE_PREFIX):
                for path in self.paths:
                    ledger.fallback(path, event[len(DENSE_PREFIX):], n, request_id=rid)


class OptimizedMHAHandle(RecordedHandle):
    """Undoes the patches and unpacks the storages; reports per-module fused/dense/backend counts."""

    def __init__(self, patches: PatchRecorder, ledger: ExecutionLedger, plans: list[SitePlan],
                 packs: dict[str, PackedLinearParameters], projections: dict[str, SharedInputProjection],
                 branches: dict[str, FusedBranchGroup]) -> None:
        super().__init__(PLUGIN_NAME, patches, ledger)
        self._plans = plans
        self.packs = packs
        self.projections = projections
        self.branches = branches

    def fold_counts(self) -> None:
        """Move the fused-branch callables' counters into the ledger (cheap; safe to call any time)."""
        for branch in self.branches.values():
            branch.fold_into(self.ledger)

    def end_request(self, request_id: str) -> None:
        self.fold_counts()
        self.ledger.finish(request_id)

    # ------------------------------------------------------------------ CUDA-graph capture
    def graph_call(self) -> GraphCall | None:
        """Beside a CUDA-graph capture: the fused-branch calls count with plain counters, so a capture takes back
        what its calls counted and every replay counts it again (``None`` without fused-branch groups)."""
        if not self.branches:
            return None
        return GraphCall(serve=self._serve_capture, replayed=self._count_replay)

    @contextlib.contextmanager
    def _serve_capture(self, buffers: Sequence[Any]) -> Iterator[dict[str, dict[str, int]]]:
        marks = {key: branch.projection.count_mark() for key, branch in self.branches.items()}
        taken: dict[str, dict[str, int]] = {}
        try:
            yield taken
        finally:
            for key, mark in marks.items():
                taken[key] = self.branches[key].projection.take_counts_since(mark)

    def _count_replay(self, taken: dict[str, dict[str, int]]) -> None:
        for key, events in taken.items():
            branch = self.branches.get(key)
            if branch is not None:
                branch.projection.add_counts(events)

    def release(self) -> None:
        self.fold_counts()
        for branch in self.branches.values():
            branch.projection.release()
        for projection in self.projections.values():
            projection.clear()
        self.packs = {}
        self.projections = {}
        self.branches = {}

    def added_weight_bytes(self) -> int:
        """Bytes of packed storage kept beyond what the model's Parameters view (0 while every pack is shared)."""
        return sum(pack.nbytes for pack in self.packs.values() if pack.weight is not None and not pack.shares_storage())

    def execution_report(self) -> dict[str, Any]:
        self.fold_counts()
        report = super().execution_report()
        report["sites"] = {plan.site.path: plan.to_json() for plan in self._plans}
        report["projection_paths"] = path_summary(self._plans)
        groups: dict[str, Any] = {}
        for key, pack in self.packs.items():
            if key in self.branches:
                verdicts, path = self.branches[key].projection.verdicts(), FUSED_BRANCH
            else:
                projection = self.projections.get(key)
                verdicts, path = (projection.verdicts() if projection is not None else {}), PROJECTION_WRAPPERS
            groups[key] = {"bytes": pack.nbytes, "shares_storage": pack.shares_storage(), "projection_path": path,
                           "bitwise_checks": verdicts}
        report["packed_groups"] = groups
        report["added_weight_bytes"] = self.added_weight_bytes()
        return report


def activate(model: nn.Module, plans: list[SitePlan]) -> OptimizedMHAHandle:
    """Pack, install each site's projection path and return the handle. A failure part-way undoes everything.

    With any fused-branch group, the model gets a forward pre-hook and an always-called forward hook
    (:class:`~worldfoundry.core.attention.packed_projection.ForwardValidation`): the groups are checked once per
    model forward instead of once per call.
    """
    ledger = ExecutionLedger(PLUGIN_NAME)
    packs: dict[str, PackedLinearParameters] = {}
    projections: dict[str, SharedInputProjection] = {}
    branches: dict[str, FusedBranchGroup] = {}
    with PatchRecorder(PLUGIN_NAME) as recorder:
        for plan in plans:
            for group in plan.groups:
                key = f"{plan.site.path}:{group.name}"
                pack = PackedLinearParameters.pack(group.modules())
                recorder.callback(pack.unpack, f"unpack {key}")
                for member in group.modules():
                    recorder.hook(member._register_state_dict_hook(_own_storage_in_state_dict),
                                  f"{PLUGIN_NAME} state_dict copies {key}")
                packs[key] = pack
                if plan.projection_path == FUSED_BRANCH:
                    projection = PackedProjection(plan.site.module, group.members, pack)
                    recorder.setattr(plan.site.module, plan.branch_attributes[group.name], projection)
                    branches[key] = FusedBranchGroup(group.paths(), f"fused_{group.name}", projection)
                else:
                    projections[key] = _wrap_group(recorder, group, pack, ledger)
            if plan.projection_path == FUSED_BRANCH:
                # set last, so the processor switches to the fused branch only once every attribute exists
                recorder.setattr(plan.site.module, "fused_projections", True)
            if plan.settings.explicit_backend:
                recorder.wrap_forward(plan.site.module, _backend_forward(plan, ledger), name=f"{PLUGIN_NAME}.sdpa")
        _refuse_diffusers_fusion(recorder, model, plans)
        if branches:
            validation = ForwardValidation([b.projection for b in branches.values()])
            recorder.hook(model.register_forward_pre_hook(validation.pre_hook), f"{PLUGIN_NAME} validation pre-hook")
            recorder.hook(model.register_forward_hook(validation.post_hook, always_call=True),
                          f"{PLUGIN_NAME} validation hook")
        patches = recorder.pop_all()
    logger.debug("%s active on %d attention module(s): %s", PLUGIN_NAME, len(plans), path_summary(plans))
    return OptimizedMHAHandle(patches, ledger, plans, packs, projections, branches)


#: Why diffusers' own projection fusion calls cannot run while the plugin is active.
FUSION_REASON = ("optimized_mha already packs these projections; diffusers' fusion would be a no-op, and "
                 "unfusing would delete the packed projection under the plugin")


def _refuse_diffusers_fusion(recorder: PatchRecorder, model: nn.Module, plans: list[SitePlan]) -> None:
    """diffusers' ``fuse_qkv_projections`` / ``unfuse_qkv_projections`` (and per attention) refuse at the call."""
    calls = {"fuse_qkv_projections": FUSION_REASON, "unfuse_qkv_projections": FUSION_REASON}
    install_call_refusals(recorder, model, calls, plugin=PLUGIN_NAME)
    for plan in plans:
        install_call_refusals(recorder, plan.site.module, {"fuse_projections": FUSION_REASON,
                                                           "unfuse_projections": FUSION_REASON},
                              plugin=PLUGIN_NAME, where=f"module {plan.site.path!r}")


def _own_storage_in_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                               local_metadata: Any) -> None:
    """State-dict hook of a packed member: its detached weight/bias get storage of their own.

    Packed Parameters view one shared storage; ``torch.save`` (``save_pretrained(safe_serialization=False)``)
    keeps that sharing, so a file saved while installed would reload as views into a larger storage. Copies
    make every serialisation write the canonical, separate tensors. ``keep_vars=True`` entries (the Parameters
    themselves) are left as they are.
    """
    for name in ("weight", "bias"):
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            state_dict[key] = value.clone(memory_format=torch.contiguous_format)


def _wrap_group(recorder: PatchRecorder, group: ProjectionGroup, pack: PackedLinearParameters,
                ledger: ExecutionLedger) -> SharedInputProjection:
    """The projection-wrapper path: the lead member runs the packed GEMM, the others take their slice."""
    modules = group.modules()
    paths = group.paths()
    projection = SharedInputProjection(pack.split_sizes, pack.current)
    kind = f"fused_{group.name}"

    def on_result(index: int, result: ProjectionResult | None) -> None:
        if result is None:
            ledger.fallback(paths[index], "unpaired_call")
        elif result.fused:
            ledger.executed(paths[index], kind)
        else:
            ledger.fallback(paths[index], result.reason or "dense")
        if index == 0 and result is not None and result.verified:
            ledger.count("bitwise_checks")
            if not result.fused:
                ledger.count("bitwise_mismatches")

    originals: list[Callable[..., Any]] = [modules[0].forward]
    for index in range(1, len(modules)):
        originals.append(modules[index].forward)
        recorder.wrap_forward(
            modules[index],
            lambda original, i=index: projection.follower_forward(i, original, on_result),
            name=PLUGIN_NAME,
        )

    def make_lead(original: Callable[..., Any]) -> Callable[..., Any]:
        members = [original, *originals[1:]]

        def forward(input: Any) -> Any:
            result = projection.compute(input, members)
            projection.offer(input, result)
            on_result(0, result)
            return result.outputs[0]

        return forward

    recorder.wrap_forward(modules[0], make_lead, name=PLUGIN_NAME)
    return projection


def _backend_forward(plan: SitePlan, ledger: ExecutionLedger) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    backend = plan.backend
    path = plan.site.path
    module = plan.site.module
    calls = plan.sdpa_calls_per_forward()
    kind = f"sdpa_{backend}"

    def make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            dispatch = diffusers_attention_backend(module.processor)
            if dispatch != NATIVE_DIFFUSERS_BACKEND:
                raise AttentionBackendError(
                    backend, f"{path} now dispatches to diffusers attention backend {dispatch!r}, not PyTorch SDPA"
                )
            with sdpa_backend_scope(backend):
                output = original(*args, **kwargs)
            ledger.executed(path, kind, n=calls)
            return output

        return forward

    return make_wrapper
