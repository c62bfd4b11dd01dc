"""``RecordedHandle``: the usual handle a plugin returns from ``activate()``.

It owns the plugin's :class:`PatchRecorder` entries and :class:`ExecutionLedger`; ``deactivate()`` undoes the
patches once (idempotent) and then calls ``release()`` so subclasses can drop derived tensors.
"""

from __future__ import annotations

from typing import Any

from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.receipts import ExecutionLedger


class RecordedHandle:
    """A reversible activation. Subclass to add ``begin_request`` / ``end_request`` / ``release``."""

    def __init__(self, name: str, patches: PatchRecorder, ledger: ExecutionLedger | None = None) -> None:
        self.name = name
        self.patches = patches
        self.ledger = ledger if ledger is not None else ExecutionLedger(name)
        self.active = True

    def deactivate(self) -> None:
        if not self.active:
            return
        self.active = False
        try:
            self.patches.undo()
        finally:
            self.release()

    def ownership_collisions(self, seen: set[tuple[int, str]], kept: dict[tuple[int, str], str]) -> list[str]:
        """Changes made since activation on top of this handle's patches (see ``PatchRecorder.collisions``)."""
        return self.patches.collisions(seen, kept) if self.active else []

    def keep_slots(self, keys: frozenset[tuple[int, str]]) -> None:
        """Leave slots someone else has set since activation as they are when deactivating."""
        self.patches.keep(keys)

    def release(self) -> None:
        """Drop derived state (packed tensors, caches). Called once after the patches are undone."""

    def execution_report(self) -> dict[str, Any]:
        report = self.ledger.report()
        report["active"] = self.active
        return report
