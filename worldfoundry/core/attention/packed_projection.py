"""A packed projection as a plain callable: the ``to_qkv`` / ``to_kv`` / ``to_added_kv`` of diffusers' fused branch.

Some diffusers attention processors (Wan, MiniMax-H3) compute the projections as
``attn.to_qkv(hidden_states).chunk(3, dim=-1)`` when ``attn.fused_projections`` is true. diffusers' own
``fuse_projections()`` makes ``to_qkv`` a new ``nn.Linear`` holding a second copy of the weights.
:class:`PackedProjection` serves the same call from the storage that the original Parameters already view
(:class:`~worldfoundry.core.attention.packed_storage.PackedLinearParameters`), so nothing is copied, and it is
*not* an ``nn.Module``: it never appears in ``_modules``, ``state_dict()``, ``parameters()`` or ``.to()``.

Per call it is one ``F.linear`` on the packed weight when

* the members are still what was packed (same modules under the same attribute names, same Parameter objects at
  the same data pointers), have no hooks (nor are global module hooks registered), and no gradient is wanted for
  their weights, and
* the input geometry (shape, strides, pointer alignment, CPU thread count, autocast dtype) was shown bitwise
  equal to the separate projections before (one dict lookup).

At a few thousand tokens a transformer forward is launch-bound, so the member check is done once per *model*
forward where possible: :class:`ForwardValidation` checks every projection of a model together in a forward
pre-hook of the model (C-level loops over flat lists), reads the CPU thread count and autocast state once, and
lets the calls inside that forward, in that thread, skip their own checks and count with a plain integer that
the model's forward hook attributes to the request. This holds only while that forward is the only one running
on the model; a second concurrent forward revokes it and every call checks and counts on its own (under a lock).
A change made while a forward runs is seen from the next forward on.

The first call of a geometry computes both and keeps the verdict. Otherwise (a stale pack, hooks, a geometry
where the fused GEMM differs) the members run as the dense model runs them (``module(x)``) and their outputs are
concatenated, so ``chunk`` hands the processor exactly the dense values.

Counting is cheap: one integer per (request id, event) under a lock; :meth:`PackedProjection.drain` hands the
counts to whoever reports them (the plugin's execution ledger).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_globals

from worldfoundry.core.acceleration.context import current_request_id
from worldfoundry.core.attention.fingerprints import MAX_ALIGNMENT
from worldfoundry.core.attention.fused_projection import NOT_BITWISE, outputs_equal
from worldfoundry.core.attention.packed_storage import PackedLinearParameters
from worldfoundry.errors import InferenceViewError

#: Event names in :meth:`PackedProjection.drain` (dense events are ``"dense:<reason>"``).
FUSED: Final = "fused"
CHECKS: Final = "bitwise_checks"
MISMATCHES: Final = "bitwise_mismatches"
DENSE_PREFIX: Final = "dense:"
#: Most geometries whose verdict is kept (the oldest is forgotten first; it is verified again if it returns).
MAX_VERDICTS: Final = 1024
#: Most distinct (request id, event) counters kept between two drains; further new ones fold into OVERFLOW_RID.
MAX_COUNTERS: Final = 4096
OVERFLOW_RID: Final = "<other>"

_GLOBAL_FORWARD_HOOKS: Final = (_module_globals._global_forward_hooks, _module_globals._global_forward_pre_hooks)
_GLOBAL_BACKWARD_HOOKS: Final = (_module_globals._global_backward_hooks, _module_globals._global_backward_pre_hooks)
_grad_enabled = torch.is_grad_enabled
_num_threads = torch.get_num_threads
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")))
_autocast_dtype = torch.get_autocast_dtype
_data_ptr = torch.Tensor.data_ptr
_get_ident = threading.get_ident


class _Trust:
    """Which thread's model forward was validated (``owner``; ``None``: none) and its call context."""

    __slots__ = ("context", "owner")

    def __init__(self) -> None:
        self.owner: int | None = None
        self.context: tuple[int, Any] = (0, None)


def _call_context(cpu: bool, device_type: str) -> tuple[int, Any]:
    """What besides the input decides the GEMM kernel: CPU thread count and the autocast dtype (if enabled)."""
    return (_num_threads() if cpu else 0, _autocast_dtype(device_type) if _any_autocast() else None)


def _member_state(name: str, module: nn.Module) -> tuple[Any, ...]:
    """``(name, module, its _parameters, weight, weight pointer, bias, bias pointer)`` as packed."""
    params = module._parameters
    weight, bias = params["weight"], params.get("bias")
    return (name, module, params, weight, weight.data_ptr(), bias, bias.data_ptr() if bias is not None else 0)


class PackedProjection:
    """``owner.<names>`` computed as one GEMM on their shared packed storage (see the module docstring).

    Args:
        owner: the attention module holding the members as child modules.
        names: the members' attribute names, in output order (``("to_q", "to_k", "to_v")``).
        pack: the packed group; its members must be ``owner.<names>`` in that order, with equal ``out_features``
            (the processor splits the output with ``chunk``).

    Raises:
        ValueError: the pack does not match ``owner.<names>`` or the sizes are unequal.
    """

    __slots__ = ("__weakref__", "_bias", "_counts", "_cpu", "_device_type", "_lock", "_members", "_n",
                 "_owner_modules", "_split_sizes", "_texts", "_trust", "_verdicts", "_weight")

    def __init__(self, owner: nn.Module, names: Sequence[str], pack: PackedLinearParameters) -> None:
        modules = tuple(owner._modules.get(n) for n in names)
        if pack.weight is None or len(modules) != len(pack.modules) or any(
                a is not b for a, b in zip(modules, pack.modules, strict=True)):
            raise ValueError(f"the pack does not hold {list(names)} of {type(owner).__name__} in that order")
        if len(set(pack.split_sizes)) != 1:
            raise ValueError(f"members of a chunked projection need equal out_features, got {pack.split_sizes}")
        self._owner_modules = owner._modules
        self._members = tuple(_member_state(n, m) for n, m in zip(names, modules, strict=True))
        self._weight: torch.Tensor | None = pack.weight
        self._bias = pack.bias
        self._split_sizes = list(pack.split_sizes)
        self._device_type = pack.weight.device.type
        self._cpu = self._device_type == "cpu"
        self._verdicts: dict[tuple[Any, ...], bool] = {}
        self._texts: dict[tuple[Any, ...], str] = {}
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._trust = _Trust()  # replaced by a ForwardValidation's shared one
        self._n = 0  # fused calls of the validated forward running now, attributed by its forward hook

    # ------------------------------------------------------------------ the call
    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        # At a few thousand tokens the model is launch-bound and every Python operation here costs directly:
        # inside a validated model forward a call is one key, one dict lookup, one GEMM and one increment.
        trust = self._trust
        if trust.owner == _get_ident():
            key = (input.shape, input.stride(), input.data_ptr() % MAX_ALIGNMENT, trust.context)
            if self._verdicts.get(key) is True:
                out = F.linear(input, self._weight, self._bias)
                self._n += 1
                return out
            return self._verify_or_dense(input, key, self._weight)
        return self._checked_call(input)

    def _checked_call(self, input: torch.Tensor) -> torch.Tensor:
        """A call outside a validated forward: check the members, count under the lock."""
        reason = self._stale()
        if reason is not None:
            return self._dense(input, reason)
        weight = self._weight
        key = (input.shape, input.stride(), input.data_ptr() % MAX_ALIGNMENT, _call_context(self._cpu,
                                                                                          self._device_type))
        if self._verdicts.get(key) is True:
            out = F.linear(input, weight, self._bias)
            rid = current_request_id()
            lock = self._lock
            lock.acquire()
            try:
                n = self._counts.get((rid, FUSED))
                if n is None:
                    self._bump_new(rid, FUSED)
                else:
                    self._counts[(rid, FUSED)] = n + 1
            finally:
                lock.release()
            return out
        return self._verify_or_dense(input, key, weight)

    def _stale(self) -> str | None:
        """Why the packed weight may not stand for the members now (``None``: it may)."""
        if self._weight is None:
            return "unpacked"
        modules = self._owner_modules
        for name, module, params, w, w_ptr, b, b_ptr in self._members:
            if modules.get(name) is not module:
                return "module_replaced"
            if params.get("weight") is not w or params.get("bias") is not b:
                return "parameter_replaced"
            if w.data_ptr() != w_ptr or (b is not None and b.data_ptr() != b_ptr):
                return "storage_changed"
            if module._forward_hooks or module._forward_pre_hooks:
                return "projection_hooks"
        if any(_GLOBAL_FORWARD_HOOKS):
            return "global_module_hooks"
        if _grad_enabled():
            for _name, module, _params, w, _w_ptr, b, _b_ptr in self._members:
                if w.requires_grad or (b is not None and b.requires_grad):
                    return "weights_require_grad"
                if module._backward_hooks or module._backward_pre_hooks:
                    return "projection_hooks"
            if any(_GLOBAL_BACKWARD_HOOKS):
                return "global_module_hooks"
        return None

    def _bump(self, event: str, n: int = 1, rid: str | None = None) -> None:
        if rid is None:
            rid = current_request_id()
        with self._lock:
            old = self._counts.get((rid, event))
            if old is None:
                self._bump_new(rid, event, n)
            else:
                self._counts[(rid, event)] = old + n

    def _attribute_pending(self, rid: str) -> None:
        """Count the fused calls of the validated forward that just ended for ``rid`` (its thread only)."""
        n = self._n
        if n:
            self._n = 0
            self._bump(FUSED, n, rid)

    def _bump_new(self, rid: str, event: str, n: int = 1) -> None:
        """Add a counter not seen since the last drain (caller holds the lock); bounded by MAX_COUNTERS."""
        counts = self._counts
        if len(counts) >= MAX_COUNTERS:
            rid = OVERFLOW_RID
        counts[(rid, event)] = counts.get((rid, event), 0) + n

    # ------------------------------------------------------------------ slow paths
    def _separate(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The members as the dense model calls them (current modules, hooks included)."""
        modules = self._owner_modules
        return [modules[member[0]](x) for member in self._members]

    def _verify_or_dense(self, x: torch.Tensor, key: tuple[Any, ...], weight: torch.Tensor) -> torch.Tensor:
        if self._verdicts.get(key) is False:
            return self._dense(x, NOT_BITWISE)
        fused = F.linear(x, weight, self._bias)
        dense = self._separate(x)
        verdict = outputs_equal(fused.split(self._split_sizes, dim=-1), dense)
        with self._lock:
            while len(self._verdicts) >= MAX_VERDICTS:
                oldest = next(iter(self._verdicts))
                del self._verdicts[oldest]
                self._texts.pop(oldest, None)
            self._verdicts[key] = verdict
            self._texts[key] = _geometry_text(x, weight, self._bias is not None, key)
        self._bump(CHECKS)
        if verdict:
            self._bump(FUSED)
            return fused
        self._bump(MISMATCHES)
        self._bump(DENSE_PREFIX + NOT_BITWISE)
        return torch.cat(dense, dim=-1)

    def _dense(self, x: torch.Tensor, reason: str) -> torch.Tensor:
        outputs = self._separate(x)
        if len({o.shape[-1] for o in outputs}) != 1:
            raise InferenceViewError(
                f"{list(self.names)} now produce {[o.shape[-1] for o in outputs]} features; the fused branch splits "
                "them into equal chunks. Uninstall the acceleration first before replacing these projections."
            )
        self._bump(DENSE_PREFIX + reason)
        return torch.cat(outputs, dim=-1)

    # ------------------------------------------------------------------ reporting and release
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(member[0] for member in self._members)

    def drain(self) -> dict[tuple[str, str], int]:
        """Counts since the last drain, keyed ``(request id, event)``; events: :data:`FUSED`, :data:`CHECKS`,
        :data:`MISMATCHES` and ``"dense:<reason>"`` (the members ran separately)."""
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts

    def take_counts_since(self, mark: tuple[int, dict[tuple[str, str], int]]) -> dict[str, int]:
        """Put the counters back to ``mark`` (from :meth:`count_mark`) and return what was counted since, by event.

        Used while a forward is captured into a CUDA graph: the capture's calls are not executions; what they
        counted is handed to :meth:`add_counts` once per replay instead.
        """
        pending, counts = mark
        with self._lock:
            since: dict[str, int] = {}
            if self._n != pending:
                since[FUSED] = self._n - pending
            for (_rid, event), n in self._counts.items():
                delta = n - counts.get((_rid, event), 0)
                if delta:
                    since[event] = since.get(event, 0) + delta
            self._n = pending
            self._counts = dict(counts)
        return since

    def count_mark(self) -> tuple[int, dict[tuple[str, str], int]]:
        """The counters now (pending fused calls of the running forward and the per-request counts)."""
        with self._lock:
            return self._n, dict(self._counts)

    def add_counts(self, events: Mapping[str, int], request_id: str | None = None) -> None:
        """Count ``events`` (as returned by :meth:`take_counts_since`) for ``request_id`` (default: current)."""
        for event, n in events.items():
            if n:
                self._bump(event, n, request_id)

    def verdicts(self) -> dict[str, bool]:
        """Checked geometries (as text) and whether the fused GEMM was bitwise equal there."""
        with self._lock:
            return {self._texts[k]: v for k, v in self._verdicts.items()}

    def release(self) -> None:
        """Drop the packed tensors and verdicts; later calls run the members separately (reason ``unpacked``)."""
        with self._lock:
            self._weight = None
            self._bias = None
            self._verdicts.clear()
            self._texts.clear()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise InferenceViewError(
            f"{self!r} serves a fused-projection branch from storage the model's Parameters view; it cannot be "
            "copied or pickled. Uninstall the acceleration first (copying or saving the model while it is installed "
            "is not supported)."
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self.__reduce_ex__(4)

    def __repr__(self) -> str:
        state = "released" if self._weight is None else f"out={sum(self._split_sizes)}"
        return f"PackedProjection({'+'.join(self.names)}, {state})"


class ForwardValidation:
    """Checks a model's :class:`PackedProjection` members once per model forward instead of once per call.

    Register :meth:`pre_hook` as a forward pre-hook and :meth:`post_hook` as an ``always_call`` forward hook of
    the model. When the forward is the only one running on the model and every projection still stands for its
    members, the pre-hook makes this thread the projections' trusted owner: their calls skip the member checks and
    count with a plain integer, which :meth:`post_hook` attributes to the current request. A concurrent second
    forward revokes the trust (its calls and the rest of the first forward check and count on their own).

    Args:
        projections: the projections whose calls happen inside the model's forward.
    """

    def __init__(self, projections: Sequence[PackedProjection]) -> None:
        self.projections = tuple(projections)
        self.trust = _Trust()
        self._lock = threading.Lock()
        self._active = 0
        self._local = threading.local()
        devices = {p._device_type for p in self.projections} or {"cpu"}
        self._device_type = devices.pop() if len(devices) == 1 else None
        owner_dicts, names, modules, param_dicts, param_names, params, tensors, ptrs, hooks = ([] for _ in range(9))
        for projection in self.projections:
            projection._trust = self.trust
            for name, module, pdict, w, w_ptr, b, b_ptr in projection._members:
                owner_dicts.append(projection._owner_modules)
                names.append(name)
                modules.append(module)
                param_dicts.extend((pdict, pdict))
                param_names.extend(("weight", "bias"))
                params.extend((w, b))
                tensors.append(w)
                ptrs.append(w_ptr)
                if b is not None:
                    tensors.append(b)
                    ptrs.append(b_ptr)
                hooks.extend((module._forward_hooks, module._forward_pre_hooks))
        self._owner_dicts, self._names, self._modules = owner_dicts, names, modules
        self._param_dicts, self._param_names, self._params = param_dicts, param_names, params
        self._tensors, self._ptrs, self._hooks = tensors, ptrs, hooks

    def valid(self) -> bool:
        """Whether every projection still stands for its members (the per-call checks, all at once)."""
        is_ = operator.is_
        ok = (self._device_type is not None
              and all(p._weight is not None for p in self.projections)
              and all(map(is_, map(dict.get, self._owner_dicts, self._names), self._modules))
              and all(map(is_, map(dict.get, self._param_dicts, self._param_names), self._params))
              and list(map(_data_ptr, self._tensors)) == self._ptrs
              and not any(map(len, self._hooks))
              and not any(_GLOBAL_FORWARD_HOOKS))
        if ok and _grad_enabled():  # rare in inference: gradients and backward hooks need the full check
            ok = all(p._stale() is None for p in self.projections)
        return ok

    def pre_hook(self, module: nn.Module, args: Any) -> None:
        # A hook that replaces the model's forward (accelerate's ``_hf_hook``: model CPU offload) may move the
        # weights after this pre-hook ran; then no trust is granted and every call checks its members itself.
        ok = getattr(module, "_hf_hook", None) is None and self.valid()
        context = _call_context(self._device_type == "cpu", self._device_type or "cpu") if ok else (0, None)
        me = _get_ident()
        left = getattr(self._local, "depth", 0)  # > 0: an earlier forward of this thread never ran its post-hook
        with self._lock:
            self._active += 1 - left
            trust = self.trust
            owned = ok and self._active == 1
            if owned:
                trust.context = context
                trust.owner = me
            else:
                trust.owner = None  # a concurrent forward (or stale members): every call checks on its own
        self._local.depth = 1
        self._local.owned = owned

    def post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if getattr(self._local, "depth", 0) <= 0:
            return  # the pre-hook did not run in this thread (an earlier pre-hook raised)
        self._local.depth = 0
        with self._lock:
            if self.trust.owner == _get_ident():
                self.trust.owner = None
            if getattr(self._local, "owned", False):
                # Only this thread's calls wrote the plain counters since it was granted the trust (also after a
                # concurrent forward revoked it: no one else is granted while this forward is still active).
                self._local.owned = False
                rid = current_request_id()
                for projection in self.projections:
                    projection._attribute_pending(rid)
            self._active -= 1


def _geometry_text(x: torch.Tensor, weight: torch.Tensor, has_bias: bool, key: tuple[Any, ...]) -> str:
    _shape, _stride, low, (threads, autocast_dtype) = key
    text = f"{x.device} {str(x.dtype).removeprefix('torch.')} x{list(x.shape)} w{list(weight.shape)}"
    if not has_bias:
        text += " no-bias"
    if threads:
        text += f" threads={threads}"
    if autocast_dtype is not None:
        text += f" autocast={str(autocast_dtype).removeprefix('torch.')}"
    if not x.is_contiguous():
        text += f" stride={list(x.stride())}"
    return text + f" align={(low & -low) if low else MAX_ALIGNMENT}"


__all__ = ["CHECKS", "DENSE_PREFIX", "FUSED", "MISMATCHES", "ForwardValidation", "PackedProjection"]
