"""``BlockOffloadEngine``: host masters for every block, r resident blocks per request, two slots for the rest.

The engine changes *where* a block's parameters point, never *what* the block computes:

* between uses, every parameter's ``.data`` is the block's host master (pinned on CUDA; a CPU copy in emulated
  mode);
* during a request, a resident block's parameters have ``.data`` swapped to the request's device copy;
* for the duration of one call of a streamed block, the block's ``_parameters`` entries hold *slot parameters*:
  ``nn.Parameter`` objects made once per (slot, block) that view the slot holding the block (same names, shapes,
  dtypes, ``requires_grad``). Swapping dictionary entries costs a fraction of swapping ``.data`` of every
  parameter twice per call; after the call the original parameter objects are back in place. Code inside the
  block's forward that reads ``module.weight`` gets the slot parameter (equal values); a reference to the
  original parameter object taken outside the call still points at the host master.

The block's own ``forward`` runs on exactly the values of the resident model, so outputs are bitwise equal.
Sub-modules keep their forwards and hooks, so adapters that patch projections inside a block (and read
weights through their modules at call time) keep working.

Lifecycle: :meth:`offload` (install) → per request :meth:`begin_request` (build the resident set) →
per model forward :meth:`begin_forward` / :meth:`run_block` ... / :meth:`end_forward` → :meth:`end_request`
(release residents and slots, return the receipt) → :meth:`restore` (uninstall, exact). A forward outside
any request is its own request. An exception inside a forward releases the resident set; the next forward
of the same request rebuilds it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import setitem
from typing import Any, TypeVar

import torch
import torch.nn as nn

from worldfoundry.core.offload.host_storage import HostBlockStorage
from worldfoundry.core.offload.layout import TENSOR_ALIGNMENT, BlockLayout
from worldfoundry.core.offload.receipts import (
    MAX_FORWARDS_LISTED,
    OffloadRequestReceipt,
)
from worldfoundry.core.offload.resident import ResidentSet
from worldfoundry.core.offload.slots import (
    DEFAULT_NUM_SLOTS,
    ForwardTransfers,
    SlotManager,
)
from worldfoundry.core.offload.streams import OffloadBackend, backend_for
from worldfoundry.errors import InferenceViewError, ModelBusyError, OffloadScheduleError

logger = logging.getLogger(__name__)

T = TypeVar("T")
_data_ptr = torch.Tensor.data_ptr


def _pointers(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(map(_data_ptr, tensors))

IMPLICIT_REQUEST = "<no-request>"


@dataclass
class _Block:
    index: int
    path: str
    module: nn.Module
    names: list[str]
    params: list[nn.Parameter]
    layout: BlockLayout
    storage: HostBlockStorage | None = None
    versions: list[int] = field(default_factory=list)
    #: data pointers the parameters must have between block calls (host masters, or resident copies)
    expected_ptrs: tuple[int, ...] = ()
    #: every place a parameter is registered in the block: (owning ``_parameters`` dict, name, parameter index)
    places: list[tuple[dict[str, Any], str, int]] = field(default_factory=list)


@dataclass
class _RequestState:
    request_id: str
    implicit: bool
    forwards: int = 0
    failed_forwards: int = 0
    transfers: int = 0
    per_forward: list[int] = field(default_factory=list)
    bytes_copied: int = 0
    copy_calls: int = 0
    misses: int = 0
    discarded: int = 0
    resident_builds: int = 0
    resident_bytes_copied: int = 0
    slot_bytes: int = 0
    resident_bytes: int = 0
    first_forward: tuple[tuple[int, int], ...] | None = None
    written_back: int = 0
    copy_wait_ms: float = 0.0


@dataclass(frozen=True)
class ForwardOutcome:
    """Returned by :meth:`BlockOffloadEngine.end_forward`: the forward's transfers and, when the forward
    was its own request (no explicit request active), that request's receipt."""

    transfers: ForwardTransfers
    receipt: OffloadRequestReceipt | None = None


def _parameter_places(block: nn.Module, params: Sequence[nn.Parameter]) -> list[tuple[dict[str, Any], str, int]]:
    """Every ``(sub-module _parameters dict, name, index in params)`` where ``params`` are registered in ``block``
    (a parameter shared by two sub-modules has two places)."""
    index = {id(p): i for i, p in enumerate(params)}
    places = []
    for module in block.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in index:
                places.append((module._parameters, name, index[id(p)]))
    return places


def block_parameters(block: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a block's offload moves, in a stable order (``named_parameters`` order)."""
    return list(block.named_parameters(remove_duplicate=True))


class BlockOffloadEngine:
    """Offloads the parameters of ``blocks`` to the host and serves them back per request.

    Args:
        blocks: ``(path, module)`` of every block, in the model's block order.
        resident_indices: positions in ``blocks`` that get device copies for a whole request.
        contiguous: one pinned slab and one copy per block (``True``) or per-tensor masters and copies.
        device: the compute device (``cuda:k``, or ``cpu`` for the emulated mode).
        num_slots: streaming slots (2).
        alignment: byte alignment of tensors inside slabs and slots.
        owner: who offloads, named in refusals ("uninstall <owner> first"): the acceleration's name.

    Raises:
        ValueError: bad indices or an unsupported device.
    """

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]], resident_indices: Sequence[int], *,
                 contiguous: bool, device: torch.device, num_slots: int = DEFAULT_NUM_SLOTS,
                 alignment: int = TENSOR_ALIGNMENT, owner: str = "block offload") -> None:
        n = len(blocks)
        indices = tuple(sorted(set(int(i) for i in resident_indices)))
        if len(indices) != len(tuple(resident_indices)) or any(not 0 <= i < n for i in indices):
            raise ValueError(f"resident indices must be distinct positions in 0..{n - 1}, got {list(resident_indices)}")
        self.device = torch.device(device)
        self.contiguous = bool(contiguous)
        self.resident_indices = indices
        self.num_slots = num_slots
        self.alignment = alignment
        self.owner = owner
        self._blocks: list[_Block] = []
        for i, (path, module) in enumerate(blocks):
            named = block_parameters(module)
            layout = BlockLayout.from_tensors([(name, p) for name, p in named], alignment=alignment)
            self._blocks.append(_Block(i, path, module, [nm for nm, _ in named], [p for _, p in named], layout,
                                       places=_parameter_places(module, [p for _, p in named])))
        #: slot parameters per slot view list (id -> (views, dicts, names, slot params, original params))
        self._slot_params: dict[int, tuple[Any, ...]] = {}
        self._resident_set = set(indices)
        self._resident_frozen = frozenset(indices)
        self.backend: OffloadBackend | None = None
        self._slots: SlotManager | None = None
        self._residents: ResidentSet | None = None
        self._resident_bound = False
        self._plan = [i for i in range(n) if i not in self._resident_set]
        self._request: _RequestState | None = None
        self._in_forward = False
        self._forward_thread: int | None = None
        self._forward_failed = False
        self._standalone = False
        self._offloaded = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ facts
    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def emulated(self) -> bool:
        return self.backend is None or self.backend.emulated

    @property
    def layout_name(self) -> str:
        return "contiguous" if self.contiguous else "per_tensor"

    @property
    def block_paths(self) -> list[str]:
        return [b.path for b in self._blocks]

    @property
    def block_bytes(self) -> list[int]:
        """Payload bytes of every block's parameters."""
        return [b.layout.payload_bytes for b in self._blocks]

    @property
    def host_bytes(self) -> int:
        """Host bytes held by the masters (slabs are padded)."""
        return sum(b.storage.nbytes for b in self._blocks if b.storage is not None)

    @property
    def pin_method(self) -> str | None:
        """How the masters are page-locked (``"cuda_host_register"``, ``"pin_memory"``), ``None`` if not."""
        methods = {b.storage.pin_method for b in self._blocks if b.storage is not None}
        return None if not methods else methods.pop() if len(methods) == 1 else "mixed"

    @property
    def pinned_bytes(self) -> int:
        """Host bytes page-locked for the masters (0 in emulated mode)."""
        return sum(b.storage.locked_bytes for b in self._blocks if b.storage is not None)

    @property
    def active_request_id(self) -> str | None:
        return self._request.request_id if self._request is not None and not self._request.implicit else None

    @property
    def in_forward(self) -> bool:
        return self._in_forward

    def is_resident(self, index: int) -> bool:
        return index in self._resident_set

    @property
    def resident_set(self) -> frozenset[int]:
        """Indices of the resident blocks."""
        return self._resident_frozen

    def device_bytes(self) -> dict[str, int]:
        """Device bytes held now by resident copies and by the slots."""
        resident = self._residents.allocated_bytes if self._residents is not None else 0
        slots = self._slots.allocated_bytes if self._slots is not None else 0
        return {"resident_bytes": resident, "slot_bytes": slots, "total": resident + slots}

    # ------------------------------------------------------------------ install / uninstall
    def offload(self) -> None:
        """Copy every block's parameters into host masters and point the parameters at them.

        On failure the blocks moved so far are restored and the error propagates.
        """
        if self._offloaded:
            return
        self.backend = backend_for(self.device)
        pin = self.backend.pin_memory
        try:
            for block in self._blocks:
                for name, p in zip(block.names, block.params):
                    if p.device != self.device:
                        raise ValueError(f"{block.path}.{name} is on {p.device}, expected {self.device}")
                block.storage = HostBlockStorage.from_tensors(
                    block.layout, [p.data for p in block.params], contiguous=self.contiguous, pin=pin,
                    device=self.device if pin else None,
                )
                self._bind(block, block.storage.masters)
                block.expected_ptrs = _pointers(block.storage.masters)
            storages = {b.index: b.storage for b in self._blocks if b.storage is not None}
            self._slots = SlotManager(self.backend, storages, num_slots=self.num_slots)
            self._residents = ResidentSet(self.backend, storages, self.resident_indices)
            self._offloaded = True
        except BaseException:
            self._restore_blocks()
            raise
        logger.info(
            "offloaded %d blocks (%s layout, %s) to the host; %d resident per request",
            len(self._blocks), self.layout_name, "emulated" if self.backend.emulated else str(self.device),
            len(self.resident_indices),
        )

    def restore(self) -> None:
        """Release any request state and put every parameter back on the device with identical values."""
        compute = self.backend.current_stream() if self.backend is not None else None
        if self._request is not None:
            self._finish_request(synchronize=False)
        if compute is not None:
            self._release_residents(compute)
            if self._slots is not None:
                self._slots.release(compute)
        self._restore_blocks()
        self._offloaded = False

    def _restore_blocks(self) -> None:
        if self.backend is not None and not self.backend.emulated:
            torch.cuda.synchronize(self.device)  # no copy may still read a master that is about to be freed
        for block in self._blocks:
            if block.storage is None:
                continue
            fresh = block.storage.restore_tensors(self.device)
            self._bind(block, fresh)
            block.storage.release()
            block.storage = None
        self._slots = None
        self._residents = None

    # ------------------------------------------------------------------ requests
    def begin_request(self, request_id: str) -> None:
        """Build the resident set for ``request_id``.

        Raises:
            ModelBusyError: another request is active on this model (one request at a time).
        """
        with self._lock:
            if self._request is not None:
                active = () if self._request.implicit else (self._request.request_id,)
                raise ModelBusyError(f"begin another request under {self.owner}", active, int(self._in_forward))
            self._request = _RequestState(request_id, implicit=False)
        try:
            self._ensure_residents(self.backend.current_stream())
        except BaseException:
            self._request = None
            raise

    def end_request(self, request_id: str) -> OffloadRequestReceipt | None:
        """Release the resident set and the slots of ``request_id``; returns its receipt (``None`` when the
        request is not the active one)."""
        state = self._request
        if state is None or state.implicit or state.request_id != request_id:
            return None
        if self._in_forward:  # a forward interrupted without its end hook (KeyboardInterrupt)
            self.end_forward(failed=True)
        return self._finish_request(synchronize=True)

    def _finish_request(self, *, synchronize: bool) -> OffloadRequestReceipt | None:
        state = self._request
        if state is None:
            return None
        compute = self.backend.current_stream()
        slot_bytes = max(state.slot_bytes, self._slots.allocated_bytes if self._slots else 0)
        resident_bytes = self._residents.allocated_bytes if self._residents is not None else 0
        self._release_residents(compute)
        if self._slots is not None:
            self._slots.release(compute)
        self._slot_params.clear()
        state.copy_wait_ms += self.backend.collect_wait_ms(synchronize=synchronize)
        self._request = None
        return OffloadRequestReceipt(
            request_id=state.request_id,
            emulated=self.backend.emulated,
            device=str(self.device),
            layout=self.layout_name,
            num_blocks=self.num_blocks,
            resident_count=len(self.resident_indices),
            resident_indices=self.resident_indices,
            forwards=state.forwards,
            failed_forwards=state.failed_forwards,
            transfers=state.transfers,
            transfers_per_forward=tuple(state.per_forward[:MAX_FORWARDS_LISTED]),
            bytes_copied=state.bytes_copied,
            copy_calls=state.copy_calls,
            copy_wait_ms=round(state.copy_wait_ms, 4),
            resident_bytes=max(resident_bytes, state.resident_bytes),
            slot_bytes=slot_bytes,
            resident_builds=state.resident_builds,
            resident_bytes_copied=state.resident_bytes_copied,
            misses=state.misses,
            discarded=state.discarded,
            first_forward_transfers=state.first_forward or (),
            weights_written_back=state.written_back,
        )

    def _ensure_residents(self, compute: Any) -> None:
        if self._resident_bound or not self.resident_indices:
            return
        views = self._residents.build(compute)
        for index, tensors in views.items():
            block = self._blocks[index]
            self._bind(block, tensors)
            block.expected_ptrs = _pointers(tensors)
            block.versions = [p._version for p in block.params]
        self._resident_bound = True
        if self._request is not None:
            self._request.resident_builds += 1
            self._request.resident_bytes_copied += self._residents.bytes_copied
            self._request.resident_bytes = max(self._request.resident_bytes, self._residents.allocated_bytes)

    def _release_residents(self, compute: Any) -> None:
        if not self._resident_bound:
            if self._residents is not None:
                self._residents.release(compute)
            return
        for index in self.resident_indices:
            block = self._blocks[index]
            changed = [k for k, p in enumerate(block.params) if p._version != block.versions[k]]
            if changed:
                logger.warning("%s: parameters written during the request; copying them back to the host masters",
                               block.path)
                with torch.no_grad():
                    for k in changed:
                        block.storage.masters[k].copy_(block.params[k].data)
                if self._request is not None:
                    self._request.written_back += 1
            self._bind(block, block.storage.masters)
            block.expected_ptrs = _pointers(block.storage.masters)
        self._resident_bound = False
        self._residents.release(compute)

    # ------------------------------------------------------------------ forwards
    def begin_forward(self, only: int | None = None) -> None:
        """Start a model forward: make residents available and prefetch the first streamed blocks.

        Args:
            only: a standalone call of this one block (not a model forward): nothing else is prefetched and,
                outside a request, no resident set is built (the block streams through a slot).

        Raises:
            ModelBusyError: another thread is inside a forward of this model.
            InferenceViewError: block parameters were replaced or moved while offloaded.
        """
        me = threading.get_ident()
        with self._lock:
            if self._in_forward:
                if self._forward_thread != me:
                    raise ModelBusyError(f"run a concurrent forward under {self.owner}", (), 1)
                stale = True
            else:
                stale = False
            self._in_forward = True
            self._forward_thread = me
        if stale:  # the previous forward of this thread never reached its end hook
            self.end_forward(failed=True)
            self._in_forward = True
            self._forward_thread = me
        try:
            if self._request is None:
                self._request = _RequestState(IMPLICIT_REQUEST, implicit=True)
            compute = self.backend.current_stream()
            if only is None or not self._request.implicit:
                self._ensure_residents(compute)
            self._check_bindings()
            self._forward_failed = False
            plan = self._plan if only is None else [only]
            self._slots.begin_forward(plan, compute)
            self._standalone = only is not None
        except BaseException:
            self._in_forward = False
            self._forward_thread = None
            if self._request is not None and self._request.implicit:
                self._finish_request(synchronize=False)
            raise

    def run_block(self, index: int, call: Callable[[], T]) -> T:
        """Run block ``index`` (its own forward, through ``call``) with its weights on the device.

        Raises:
            OffloadScheduleError: called outside :meth:`begin_forward` / :meth:`end_forward`.
        """
        if not self._in_forward:
            raise OffloadScheduleError("run_block called outside a forward; call begin_forward first")
        if index in self._resident_set and self._resident_bound:
            try:
                return call()
            except BaseException:
                self._forward_failed = True
                raise
        block = self._blocks[index]
        views = self._slots.acquire(index)
        ok = False
        bound = self._slot_parameters(block, views)
        _, dicts, names, slot_params, originals = bound
        deque(map(setitem, dicts, names, slot_params), maxlen=0)
        try:
            result = call()
            ok = True
            return result
        except BaseException:
            self._forward_failed = True
            raise
        finally:
            deque(map(setitem, dicts, names, originals), maxlen=0)
            self._slots.release_block(index, prefetch=ok)

    def end_forward(self, *, failed: bool = False) -> ForwardOutcome:
        """Finish a forward. On failure the resident set is released (rebuilt by the next forward)."""
        if not self._in_forward:
            return ForwardOutcome(ForwardTransfers())
        failed = failed or self._forward_failed
        stats = self._slots.end_forward()
        state = self._request
        receipt = None
        try:
            if state is not None:
                state.forwards += 1
                state.failed_forwards += int(failed)
                state.transfers += stats.transfers
                state.per_forward.append(stats.transfers)
                state.bytes_copied += stats.bytes_copied
                state.copy_calls += stats.copy_calls
                state.misses += stats.misses
                state.discarded += stats.discarded
                state.slot_bytes = max(state.slot_bytes, self._slots.allocated_bytes)
                state.copy_wait_ms += self.backend.collect_wait_ms(synchronize=False)
                if state.first_forward is None:
                    state.first_forward = tuple(stats.transfer_log)
            if not failed and not self._standalone and stats.order and stats.order != self._plan:
                self._plan = list(stats.order)
            if failed:
                self._release_residents(self.backend.current_stream())
            if state is not None and state.implicit:
                receipt = self._finish_request(synchronize=False)
        finally:
            self._in_forward = False
            self._forward_thread = None
            self._forward_failed = False
        return ForwardOutcome(stats, receipt)

    # ------------------------------------------------------------------ bindings
    def _slot_parameters(self, block: _Block, views: list[torch.Tensor]) -> tuple[Any, ...]:
        """The slot parameters of ``block`` over ``views`` (made on first use of that slot view list)."""
        bound = self._slot_params.get(id(views))
        if bound is not None and bound[0] is views:
            return bound
        params = [nn.Parameter(v, requires_grad=p.requires_grad) for v, p in zip(views, block.params)]
        places = block.places
        bound = (views, [d for d, _, _ in places], [n for _, n, _ in places], [params[i] for _, _, i in places],
                 [block.params[i] for _, _, i in places])
        self._slot_params[id(views)] = bound
        return bound

    @staticmethod
    def _bind(block: _Block, tensors: Sequence[torch.Tensor]) -> None:
        for p, t in zip(block.params, tensors):
            p.data = t

    def _check_bindings(self) -> None:
        # Once per forward, so kept cheap: a parameter replaced, moved or cast gets new memory (a new pointer).
        for block in self._blocks:
            if block.storage is None or _pointers(block.params) == block.expected_ptrs:
                continue
            if block.index in self._resident_set and self._resident_bound:
                expected = self._residents.views(block.index)
            else:
                expected = block.storage.masters
            for name, p, t in zip(block.names, block.params, expected):
                if p.data_ptr() != t.data_ptr() or p.dtype != t.dtype or p.device != t.device:
                    raise InferenceViewError(
                        f"{block.path}.{name} was replaced or moved while {self.owner} offloads it "
                        f"(model.to(), a dtype change or a parameter swap); uninstall {self.owner} first, "
                        "change the model, then install again"
                    )

    def close(self) -> None:
        """Forget the blocks (after :meth:`restore`)."""
        self._blocks = []
        self.backend = None
