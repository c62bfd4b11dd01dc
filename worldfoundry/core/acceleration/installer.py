"""``install_diffusion_accelerations``: prepare all -> conflict check -> transactional activate with rollback."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from worldfoundry.core.acceleration.guard import (
    RequestGuard,
    attach_request_guard,
    detach_request_guard,
    get_request_guard,
)
from worldfoundry.core.acceleration.prepared import ROOT_MODULE, PreparedAcceleration, is_role
from worldfoundry.core.acceleration.receipts import InstallReceipt, PluginInstallRecord
from worldfoundry.core.acceleration.registry import AccelerationRegistry, diffusion_acceleration_registry
from worldfoundry.core.acceleration.session import (
    SESSION_ATTRIBUTE,
    SINGLE_MODEL_LABEL,
    AccelerationSession,
    ActiveAcceleration,
    deactivate_all,
)
from worldfoundry.core.acceleration.copy_refusal import COPY_REFUSAL, refuse_copies
from worldfoundry.core.acceleration.snapshot import ModuleTreeSnapshot
from worldfoundry.core.acceleration.spec import (
    check_per_expert,
    expert_options,
    freeze_options,
    normalize_acceleration_spec,
)
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import (
    AccelerationConflictError,
    AccelerationInstallError,
    SessionAlreadyInstalledError,
    WorldFoundryError,
)

logger = logging.getLogger(__name__)

ModelOrExperts = nn.Module | Mapping[str, nn.Module] | Sequence[nn.Module]


def normalize_targets(model: ModelOrExperts) -> dict[str, nn.Module]:
    """One module -> ``{"model": module}``; a mapping of experts is kept; a sequence gets ``expert0..n``."""
    if isinstance(model, nn.Module):
        return {SINGLE_MODEL_LABEL: model}
    if isinstance(model, Mapping):
        targets = dict(model)
    elif isinstance(model, Sequence) and not isinstance(model, str):
        targets = {f"expert{i}": m for i, m in enumerate(model)}
    else:
        raise TypeError(f"model must be an nn.Module or a mapping/sequence of them, got {type(model).__name__}")
    if not targets or not all(isinstance(m, nn.Module) for m in targets.values()):
        raise TypeError("every expert must be an nn.Module")
    if len({id(m) for m in targets.values()}) != len(targets):
        raise ValueError("the same module is listed twice among the experts")
    return targets


def _shared_guard(targets: Mapping[str, nn.Module]) -> tuple[RequestGuard, tuple[str, ...]]:
    """The experts' one guard (attached where missing) and the labels it was attached to now."""
    guards = {id(g): g for g in (get_request_guard(m) for m in targets.values()) if g is not None}
    if len(guards) > 1:
        raise ValueError("the experts have different request guards; experts installed together must share one")
    guard: RequestGuard | None = next(iter(guards.values()), None)
    attached = tuple(label for label, module in targets.items() if get_request_guard(module) is None)
    for module in targets.values():
        guard = attach_request_guard(module, guard)
    if guard is None:  # pragma: no cover - targets is never empty
        raise ValueError("no model to guard")
    return guard, attached


def is_diffusion_pipeline(obj: Any) -> bool:
    """A diffusers ``DiffusionPipeline`` (checked without importing diffusers when it is not loaded)."""
    import sys

    module = sys.modules.get("diffusers")
    pipeline_cls = getattr(module, "DiffusionPipeline", None) if module is not None else None
    return pipeline_cls is not None and isinstance(obj, pipeline_cls)


def _default_policy(targets: Mapping[str, nn.Module]) -> RuntimePolicy:
    first = next(iter(targets.values()))
    param = next(first.parameters(), None)
    if param is None:
        return RuntimePolicy()
    dtype = param.dtype if param.dtype.is_floating_point else torch.float32
    return RuntimePolicy(device=param.device, dtype=dtype)


def _check_conflicts(prepared: list[tuple[str, PreparedAcceleration]]) -> None:
    """Raise on the first shared claim or declared incompatibility, before anything is activated."""
    owners: dict[tuple[str, str], str] = {}
    for expert, plan in prepared:
        for claim in sorted(plan.claims):
            key = (expert, claim)
            other = owners.get(key)
            if other is not None and other != plan.name:
                where = claim if expert == SINGLE_MODEL_LABEL else f"{expert}/{claim}"
                raise AccelerationConflictError(other, plan.name, where)
            owners[key] = plan.name
    by_name: dict[str, set[str]] = {}
    for _, plan in prepared:
        by_name.setdefault(plan.name, set()).update(plan.claims)
    declared: dict[str, set[str]] = {}
    for _, plan in prepared:
        declared.setdefault(plan.name, set()).update(plan.incompatible_with)
    names = sorted(by_name)
    for a in names:
        for b in names:
            if a == b:
                continue
            if b in declared[a]:
                raise AccelerationConflictError(a, b, b, reason=f"{a!r} declares itself incompatible with")
            shared = sorted(declared[a] & by_name[b])
            if shared:
                raise AccelerationConflictError(a, b, shared[0], reason=f"{a!r} cannot run with a plugin claiming")


def install_diffusion_accelerations(
    model: ModelOrExperts | Any,
    spec: Mapping[str, Any],
    policy: RuntimePolicy | None = None,
    *,
    registry: AccelerationRegistry | None = None,
) -> AccelerationSession | Any:
    """Install accelerations on an idle model, a group of experts (one session), or a diffusers pipeline.

    Args:
        model: the diffusers module, ``{"high": m1, "low": m2}`` for routed experts, or a diffusers
            ``DiffusionPipeline`` (every DiT of it, with a request scope per ``pipe(...)`` call; see
            :func:`worldfoundry.integrations.diffusers_pipeline.accelerate_pipeline`).
        spec: ``{name: options mapping or True}``.
        policy: runtime policy handed to every factory (defaults to the model's device/dtype).
        registry: where names are looked up (the process default when ``None``).

    Returns:
        The :class:`AccelerationSession`, also attached at ``model._worldfoundry_accelerations`` (for a pipeline:
        a :class:`~worldfoundry.integrations.diffusers_pipeline.PipelineAcceleration`).

    Raises:
        ModelBusyError: a request or forward is active.
        SessionAlreadyInstalledError: uninstall the current session first.
        UnknownAccelerationError: a name is not registered (the message lists the known ones).
        AccelerationOptionsError / AccelerationRefusedError: a factory rejected its options or the model.
        AccelerationConflictError: two plans claim the same module/role or declare each other incompatible.
        AccelerationInstallError: activation failed; everything was rolled back (cause chained).
    """
    if is_diffusion_pipeline(model):
        from worldfoundry.integrations.diffusers_pipeline import accelerate_pipeline

        return accelerate_pipeline(model, spec, policy, registry=registry)
    targets = normalize_targets(model)
    normalized = normalize_acceleration_spec(spec, where="spec")
    registry = registry if registry is not None else diffusion_acceleration_registry()
    policy = policy if policy is not None else _default_policy(targets)
    guard, attached = _shared_guard(targets)
    try:
        with guard.mutation("install accelerations"):
            session = _install_locked(targets, normalized, policy, registry, guard, attached)
    except BaseException:
        for label in attached:  # a refused install leaves no guard behind
            detach_request_guard(targets[label])
        raise
    logger.info("installed accelerations %s on %s", list(session.names), session.receipt.model_class)
    return session


def _install_locked(targets: dict[str, nn.Module], normalized: dict[str, dict[str, Any]], policy: RuntimePolicy,
                    registry: AccelerationRegistry, guard: RequestGuard,
                    attached: tuple[str, ...]) -> AccelerationSession:
    """Prepare all, check conflicts, activate; runs inside the guard's mutation."""
    for module in targets.values():
        existing = module.__dict__.get(SESSION_ATTRIBUTE)
        if existing is not None:
            raise SessionAlreadyInstalledError(existing.names)
    entries = {name: registry.get(name) for name in normalized}  # unknown names raise here
    check_per_expert(normalized, list(targets))
    snapshots = {label: ModuleTreeSnapshot(module) for label, module in targets.items()}
    prepared = _prepare_all(targets, normalized, entries, policy, snapshots)
    _check_conflicts(prepared)
    active = _activate_all(prepared, targets, snapshots)
    receipt = _build_receipt(targets, prepared, entries)
    copies = refuse_copies(targets, receipt.names)
    installed = {label: ModuleTreeSnapshot(module) for label, module in targets.items()}
    session = AccelerationSession(targets, active, receipt, guard, snapshots, installed, attached)
    session.add_companion(COPY_REFUSAL, copies)
    for module in targets.values():
        object.__setattr__(module, SESSION_ATTRIBUTE, session)
    guard.add_listener(session)
    return session


def _prepare_all(targets: Mapping[str, nn.Module], normalized: Mapping[str, dict[str, Any]],
                 entries: Mapping[str, Any], policy: RuntimePolicy,
                 snapshots: Mapping[str, ModuleTreeSnapshot]) -> list[tuple[str, PreparedAcceleration]]:
    """Prepare every (acceleration, expert) and prove nothing changed; a failure puts back what prepare did."""
    prepared: list[tuple[str, PreparedAcceleration]] = []
    try:
        for name, options in normalized.items():
            for label, module in targets.items():
                plan = _prepare_one(entries[name].factory, name, module, expert_options(options, label), policy)
                diffs = snapshots[label].differences()
                if diffs:
                    raise AccelerationInstallError(
                        name, f"its prepare step changed the model ({label}): {diffs[:5]}; prepare must only "
                        "validate (make changes in activate())"
                    )
                _check_claimed_paths(plan, label, module)
                prepared.append((label, plan))
    except BaseException:
        for snapshot in snapshots.values():  # the install holds the model: only a prepare step changed it
            snapshot.restore()
        raise
    return prepared


def _activate_all(prepared: list[tuple[str, PreparedAcceleration]], targets: Mapping[str, nn.Module],
                  snapshots: Mapping[str, ModuleTreeSnapshot]) -> list[ActiveAcceleration]:
    """Activate in a deterministic order; on failure deactivate what ran, in reverse, and re-raise."""
    order = sorted(range(len(prepared)), key=lambda i: (prepared[i][1].name, list(targets).index(prepared[i][0])))
    active: list[ActiveAcceleration] = []
    for i in order:
        label, plan = prepared[i]
        try:
            handle = plan.activate()
            if not callable(getattr(handle, "deactivate", None)):
                raise TypeError(f"activate() of {plan.name!r} returned {type(handle).__name__} without deactivate()")
        except BaseException as exc:
            rollback_errors = deactivate_all(active)
            drift = [f"{lb}: {d}" for lb, s in snapshots.items() for d in s.restore()]
            detail = f"{type(exc).__name__}: {exc}"
            if rollback_errors:
                detail += f"; {len(rollback_errors)} rollback error(s): " + "; ".join(map(str, rollback_errors))
            if drift:
                detail += f"; structure restored from snapshot ({len(drift)} difference(s))"
            if not isinstance(exc, Exception):
                raise
            raise AccelerationInstallError(plan.name, detail) from exc
        active.append(ActiveAcceleration(plan.name, label, plan, handle))
    return active


def _check_claimed_paths(plan: PreparedAcceleration, label: str, module: nn.Module) -> None:
    """Every non-role claim must be ``"<root>"`` or a path of ``module.named_modules()``."""
    paths = [c for c in plan.claims if not is_role(c) and c != ROOT_MODULE]
    if not paths:
        return
    known = {name for name, _ in module.named_modules(remove_duplicate=False)}
    unknown = sorted(c for c in paths if c not in known)
    if unknown:
        where = "" if label == SINGLE_MODEL_LABEL else f" of expert {label!r}"
        raise AccelerationInstallError(
            plan.name,
            f"prepare claimed module path(s) {unknown[:5]} that do not exist in {type(module).__name__}{where}; "
            f"claims must be paths from model.named_modules(), {ROOT_MODULE!r} or 'role:<name>'",
        )


def _prepare_one(factory: Any, name: str, module: nn.Module, options: dict[str, Any],
                 policy: RuntimePolicy) -> PreparedAcceleration:
    try:
        plan = factory(module, freeze_options(options), policy)
    except WorldFoundryError:
        raise
    except Exception as exc:
        raise AccelerationInstallError(name, f"prepare failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(plan, PreparedAcceleration):
        raise AccelerationInstallError(name, f"prepare factory returned {type(plan).__name__}, not PreparedAcceleration")
    if plan.name != name:
        raise AccelerationInstallError(name, f"prepare factory returned a plan named {plan.name!r}")
    return plan


def _build_receipt(targets: Mapping[str, nn.Module], prepared: list[tuple[str, PreparedAcceleration]],
                   entries: Mapping[str, Any]) -> InstallReceipt:
    records: dict[str, PluginInstallRecord] = {}
    experts: dict[str, list[str]] = {}
    claims: dict[str, set[str]] = {}
    for label, plan in prepared:
        experts.setdefault(plan.name, []).append(label)
        claims.setdefault(plan.name, set()).update(
            plan.claims if label == SINGLE_MODEL_LABEL else {f"{label}/{c}" for c in plan.claims}
        )
    for label, plan in prepared:
        if plan.name in records:
            continue
        entry = entries[plan.name]
        mine = [(lab, p) for lab, p in prepared if p.name == plan.name]
        per_expert = {lab: dict(p.options) for lab, p in mine}
        exacts = [p.exact for _, p in mine]
        records[plan.name] = PluginInstallRecord(
            name=plan.name,
            options=dict(plan.options),
            claims=tuple(sorted(claims[plan.name])),
            distribution=entry.distribution,
            version=entry.version,
            # exact only when every expert's plan is (per-expert options can make one approximate)
            exact=False if False in exacts else (True if all(e is True for e in exacts) else None),
            experts=tuple(experts[plan.name]),
            notes=plan.notes,
            per_expert_options=per_expert if len({repr(sorted(o.items())) for o in per_expert.values()}) > 1
            else {},
        )
    first = next(iter(targets.values()))
    return InstallReceipt(tuple(records.values()), type(first).__name__, tuple(targets))
