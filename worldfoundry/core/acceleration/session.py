"""``AccelerationSession``: the installed set of accelerations on one model (or one group of experts)."""

from __future__ import annotations

import copy
import gc
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from worldfoundry.core.acceleration.guard import RequestGuard, detach_request_guard, get_request_guard
from worldfoundry.core.acceleration.prepared import AccelerationHandle, PreparedAcceleration, is_role
from worldfoundry.core.acceleration.receipts import InstallReceipt, jsonable
from worldfoundry.core.acceleration.snapshot import ModuleTreeSnapshot, repair_leftovers
from worldfoundry.errors import AccelerationRestoreError, OwnershipCollisionError

logger = logging.getLogger(__name__)

SESSION_ATTRIBUTE = "_worldfoundry_accelerations"
SINGLE_MODEL_LABEL = "model"


@dataclass
class ActiveAcceleration:
    name: str
    expert: str
    prepared: PreparedAcceleration
    handle: AccelerationHandle


class AccelerationSession:
    """Returned by :func:`install_diffusion_accelerations` and attached at ``model._worldfoundry_accelerations``.

    ``uninstall()`` undoes exactly what the session changed (idempotent), detaches the session (and the request
    guard, when the install attached it) and frees derived tensors. Changes made after install by anyone else
    are kept; one that sits on top of something to undo makes uninstall refuse before changing anything.
    """

    def __init__(self, targets: Mapping[str, nn.Module], active: list[ActiveAcceleration], receipt: InstallReceipt,
                 guard: RequestGuard, snapshots: Mapping[str, ModuleTreeSnapshot],
                 installed_snapshots: Mapping[str, ModuleTreeSnapshot] | None = None,
                 attached_guard: tuple[str, ...] = ()) -> None:
        self._targets = dict(targets)
        self._active = list(active)
        self.receipt = receipt
        self._guard = guard
        self._snapshots = dict(snapshots)
        self._installed_snapshots = dict(installed_snapshots or {})
        self._attached_guard = tuple(attached_guard)
        self._companions: list[tuple[str, AccelerationHandle]] = []
        self._final_report: dict[str, Any] | None = None
        #: what install changed that a plugin's undo left (a plugin bug); repaired slot by slot, never touching
        #: anything changed after install
        self.restore_differences: list[str] = []
        #: parameters / buffers set by someone else after install in slots the session had changed: kept as is
        self.kept_changes: list[str] = []

    @property
    def guard(self) -> RequestGuard:
        return self._guard

    def add_companion(self, name: str, handle: AccelerationHandle) -> None:
        """Attach a recorded change made next to the plugins (e.g. a pipeline's request scope). Companions are
        checked for collisions and undone first on :meth:`uninstall`."""
        self._companions.append((name, handle))

    # ------------------------------------------------------------------ state
    @property
    def installed(self) -> bool:
        return self._final_report is None

    @property
    def names(self) -> tuple[str, ...]:
        return self.receipt.names

    @property
    def models(self) -> dict[str, nn.Module]:
        return dict(self._targets)

    def handles(self, name: str) -> dict[str, AccelerationHandle]:
        """The live handles of acceleration ``name`` keyed by expert label (for tests and diagnostics)."""
        return {a.expert: a.handle for a in self._active if a.name == name}

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for work the plugins do in the background that changes what later calls run (block fusion's
        kernels compiling while the original forwards run, ``kernel_compile: background``).

        Args:
            timeout: seconds in all (``None``: no limit).

        Returns:
            ``True`` when no plugin has such work running any more, ``False`` when ``timeout`` ran out first.
        """
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        for entry in self._active:
            wait = getattr(entry.handle, "wait_ready", None)
            if wait is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not wait(left):
                return False
        return True

    # ------------------------------------------------------------------ request callbacks (from the guard)
    def on_begin_request(self, request_id: str) -> None:
        """Tell every handle a request begins. If one refuses, the handles already told are ended again."""
        begun: list[ActiveAcceleration] = []
        try:
            for entry in self._active:
                begin = getattr(entry.handle, "begin_request", None)
                if begin is not None:
                    begin(request_id)
                    begun.append(entry)
        except BaseException:
            for entry in reversed(begun):
                try:
                    entry.handle.end_request(request_id)  # type: ignore[attr-defined]
                except Exception as exc:  # the original error is the one to report
                    logger.error("ending request %r on %s after a failed begin failed: %s", request_id, entry.name, exc)
            raise

    def on_end_request(self, request_id: str) -> None:
        errors: list[BaseException] = []
        for entry in reversed(self._active):
            end = getattr(entry.handle, "end_request", None)
            if end is not None:
                try:
                    end(request_id)
                except BaseException as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]

    def on_release_thread(self) -> None:
        """A request failed in this thread: handles forget forwards of this thread that never finished."""
        for entry in self._active:
            release = getattr(entry.handle, "release_thread", None)
            if release is not None:
                try:
                    release()
                except Exception as exc:  # the request's own failure is the one to report
                    logger.error("releasing this thread's forwards in %s failed: %s", entry.name, exc)

    def prepare_request_schedule(self, request_id: str, schedule: Any) -> None:
        for entry in self._active:
            prepare = getattr(entry.handle, "prepare_request_schedule", None)
            if prepare is not None:
                prepare(request_id, schedule)

    # ------------------------------------------------------------------ reports
    def execution_report(self) -> dict[str, Any]:
        """Per plugin, per expert: the handle's execution report (bounded, JSON-serialisable).

        Each expert's report also lists the plugin's ``claims`` and, for every request the ledger kept,
        ``claimed_not_executed``: claimed module paths with no ``executed`` record in that request (a configured
        module that never ran is visible as such). After :meth:`uninstall` the last report is returned.
        """
        if self._final_report is not None:
            return copy.deepcopy(self._final_report)
        plugins: dict[str, dict[str, Any]] = {}
        for entry in self._active:
            report_fn = getattr(entry.handle, "execution_report", None)
            report = report_fn() if report_fn is not None else {"plugin": entry.name, "reports_execution": False}
            report = jsonable(report) if isinstance(report, Mapping) else {"plugin": entry.name, "report": str(report)}
            _add_claim_coverage(report, entry.prepared.claims)
            plugins.setdefault(entry.name, {})[entry.expert] = report
        return {"installed": True, "execution_verified": False, "plugins": plugins}

    # ------------------------------------------------------------------ uninstall
    def collisions(self, kept: dict[tuple[int, str], str] | None = None) -> list[str]:
        """Changes made after install on top of what uninstall must undo (empty: uninstall is safe).

        Visited in undo order (companions, then plugins newest first), sharing one set of slots, so a slot two
        of this session's patches changed in turn is checked once, against the last of them.

        Args:
            kept: filled with the slots whose tensors were replaced since install (they stay as they are).
        """
        seen: set[tuple[int, str]] = set()
        kept = {} if kept is None else kept
        found: list[str] = []
        for name, expert, handle in self._undo_order():
            check = getattr(handle, "ownership_collisions", None)
            if check is None:
                continue
            where = name if expert in ("", SINGLE_MODEL_LABEL) else f"{name} ({expert})"
            found.extend(f"{where}: {text}" for text in check(seen, kept))
        return found

    def _undo_order(self) -> list[tuple[str, str, Any]]:
        visits = [(name, "", handle) for name, handle in reversed(self._companions)]
        return visits + [(a.name, a.expert, a.handle) for a in reversed(self._active)]

    def uninstall(self) -> None:
        """Deactivate every acceleration in reverse activation order, undoing exactly what each changed.

        Raises:
            ModelBusyError: a request or forward is active.
            OwnershipCollisionError: something changed after install sits on top of a change to undo (named
                each); nothing was changed, the session stays installed.
            AccelerationRestoreError: a plugin's undo failed; the others were still undone and the session is
                detached.
        """
        if not self.installed:
            return
        with self._guard.mutation("uninstall accelerations"):
            if not self.installed:  # another thread finished the uninstall first
                return
            kept: dict[tuple[int, str], str] = {}
            collisions = self.collisions(kept)
            if collisions:
                raise OwnershipCollisionError(collisions)
            for _, _, handle in self._undo_order():
                keep = getattr(handle, "keep_slots", None)
                if keep is not None:
                    keep(frozenset(kept))
            self.kept_changes = sorted(kept.values())
            if kept:
                logger.info("uninstall keeps %d value(s) set after install: %s", len(kept), self.kept_changes[:5])
            report = self.execution_report()
            report["installed"] = False
            companions = [ActiveAcceleration(n, "", None, h) for n, h in self._companions]  # type: ignore[arg-type]
            errors = deactivate_all(companions)
            errors += deactivate_all(self._active)
            self._guard.remove_listener(self)
            self._detach()
            self._final_report = report
            self._active.clear()
            self._companions.clear()
        _collect_device_garbage()
        if errors:
            raise AccelerationRestoreError(errors)

    def _detach(self) -> None:
        """Drop the session attribute and the guard the install attached, then look for leftovers."""
        for label, model in self._targets.items():
            if model.__dict__.get(SESSION_ATTRIBUTE) is self:
                del model.__dict__[SESSION_ATTRIBUTE]
            if label in self._attached_guard:
                detach_request_guard(model)
        for label, before in self._snapshots.items():
            after = self._installed_snapshots.get(label)
            found = repair_leftovers(before, after) if after is not None else []
            if found:
                logger.warning("uninstall repaired changes of the install a plugin left on %s: %s", label, found[:10])
                self.restore_differences.extend(f"{label}: {d}" for d in found)
        self._snapshots.clear()
        self._installed_snapshots.clear()
        self._targets.clear()

    def __repr__(self) -> str:
        state = "installed" if self.installed else "uninstalled"
        return f"AccelerationSession({list(self.names)}, {state})"


def _collect_device_garbage() -> None:
    """Derived tensors are freed by reference counting once the handles drop them; on a CUDA process a full
    collection also frees any caught in reference cycles, so their device memory is reusable right away.
    (Skipped elsewhere: a full collection costs a noticeable fraction of a second in a process holding torch.)"""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()


def _add_claim_coverage(report: dict[str, Any], claims: frozenset[str]) -> None:
    paths = sorted(c for c in claims if not is_role(c))
    report["claims"] = sorted(claims)
    requests = report.get("requests")
    if not isinstance(requests, Mapping):
        return
    for record in requests.values():
        if isinstance(record, dict) and isinstance(record.get("modules"), Mapping):
            ran = record["modules"]
            record["claimed_not_executed"] = [p for p in paths if p not in ran]


def deactivate_all(active: list[ActiveAcceleration]) -> list[BaseException]:
    """Deactivate in reverse order, continuing past failures. Returns the errors."""
    errors: list[BaseException] = []
    for entry in reversed(active):
        try:
            entry.handle.deactivate()
        except Exception as exc:
            logger.error("deactivating %s (%s) failed: %s", entry.name, entry.expert, exc)
            errors.append(exc)
    return errors


def get_session(model: nn.Module) -> AccelerationSession | None:
    return model.__dict__.get(SESSION_ATTRIBUTE)


def runtime_optimization_report(model: nn.Module) -> dict[str, Any]:
    """The model-level aggregation: install receipt, per-plugin execution reports and guard state."""
    session = get_session(model)
    guard = get_request_guard(model)
    report: dict[str, Any] = {
        "installed": session.receipt.to_json() if session is not None else None,
        "execution_verified": False,
        "plugins": session.execution_report()["plugins"] if session is not None else {},
    }
    if guard is not None:
        report["guard"] = {"active_request_ids": list(guard.active_request_ids()), "active_forwards": guard.active_forwards}
    return report
