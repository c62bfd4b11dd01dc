"""Run-time glue of ``selective_fp8``: the patched Linear forward, the per-call path choice and the handle.

Each selected Linear keeps its dense weight; its forward is replaced by one that either

* runs FP8: fused Triton activation quantization + ``torch._scaled_mm`` + bias, recorded as
  ``executed(path, "fp8_gemm")``, or
* runs the original dense forward, recorded as ``fallback(path, reason)`` with one of the reasons in
  :data:`FALLBACK_REASONS` (``"cpu device"``, ``"gpu lacks fp8"``, ``"fewer than min_tokens rows"``, ...) or
  the reason of the capability probe (``"rowwise torch._scaled_mm unavailable on <device>: ..."``): on a device
  the policy allows, the exact ``torch._scaled_mm`` call is tried once before any forward uses it
  (:func:`~worldfoundry.core.acceleration.quantization.fp8_linear.rowwise_scaled_mm_unavailable_reason`).

When both Linears of a diffusers ``FeedForward`` are selected, the FFN's forward is replaced as well (see
:mod:`worldfoundry_selective_fp8.ffn_fusion`): the down projection's GELU and activation quantization then run
as one kernel, recorded as ``executed(ffn_path, "fp8_gelu_fused")``.

The numerics live in :mod:`worldfoundry.core.acceleration.quantization` and
:mod:`worldfoundry.core.acceleration.kernels`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Final

import torch
import torch.nn as nn

from worldfoundry.base_models.diffusion_model.optimizations.guards import WeightViewGuard
from worldfoundry.core.acceleration.kernels.dispatch import quantize_activations_rowwise_fp8
from worldfoundry.core.acceleration.quantization.fp8 import CLIP_THRESHOLD
from worldfoundry.core.acceleration.quantization.fp8_linear import (
    FP8RowwiseWeight,
    fp8_linear_fallback_reason,
    rowwise_scaled_mm_unavailable_reason,
    scaled_mm_rowwise,
)
from worldfoundry.plugin import ExecutionLedger, PatchRecorder, RecordedHandle
from worldfoundry_selective_fp8.ffn_fusion import FUSED_KIND
from worldfoundry_selective_fp8.options import PLUGIN_NAME, Options

logger = logging.getLogger(__name__)

#: ``ledger.executed`` kind of an FP8 call.
EXECUTED_KIND: Final = "fp8_gemm"
REASON_DTYPE: Final = "dtype not bfloat16"
REASON_FEW_ROWS: Final = "fewer than min_tokens rows"
REASON_AUTOGRAD: Final = "autograd enabled"
REASON_OTHER_DEVICE: Final = "input on another device than the weight"
#: Every fixed reason a dense fallback can carry (device reasons are ``"<type> device"``, e.g. ``"cpu device"``;
#: a failed capability probe adds its own ``"rowwise torch._scaled_mm ..."`` reason).
FALLBACK_REASONS: Final = (
    "cpu device", "gpu lacks fp8", "torch._scaled_mm unavailable", REASON_DTYPE, REASON_FEW_ROWS,
    REASON_AUTOGRAD, REASON_OTHER_DEVICE,
)
#: Counter bumped when the activation quantization ran the torch reference instead of the Triton kernel.
QUANT_REFERENCE_COUNTER: Final = "activation_quant_torch_reference"


class _Target:
    __slots__ = ("path", "linear", "weight", "in_features", "out_features")

    def __init__(self, path: str, linear: nn.Linear, weight: FP8RowwiseWeight) -> None:
        self.path = path
        self.linear = linear
        self.weight = weight
        self.in_features = linear.in_features
        self.out_features = linear.out_features


class SelectiveFP8Runtime:
    """State shared by the patched forwards of one activation (one model or one expert).

    Attributes:
        device_reasons: per-device cache of :func:`fp8_linear_fallback_reason` (``None``: FP8 can run), filled
            when a weight's device is first seen (at activation) or an input's device first arrives.
            :meth:`allow_device` lets the FP8 path run on a device the policy skips (the CPU, for tests and
            verification) when the capability probe passes there.
    """

    def __init__(self, options: Options, ledger: ExecutionLedger, guard: WeightViewGuard) -> None:
        self.options = options
        self.ledger = ledger
        self.guard = guard
        self.targets: dict[str, _Target] = {}
        self.device_reasons: dict[torch.device, str | None] = {}
        self._clip_counters: dict[str, torch.Tensor] = {}
        self._clip_lock = threading.Lock()
        self.clipped_total = 0
        #: ``ledger.executed`` kind of an FP8 Linear call.
        self.executed_kind = EXECUTED_KIND
        #: FFN path -> why it is not fused (candidates only), filled at activation.
        self.not_fused: dict[str, str] = {}
        self.fused_ffns: tuple[str, ...] = ()

    # ------------------------------------------------------------------ construction
    def add(self, path: str, linear: nn.Linear, weight: FP8RowwiseWeight) -> None:
        self.targets[path] = _Target(path, linear, weight)
        self.device_reason(weight.qweight.device)  # probe at activation, not inside a forward

    def device_reason(self, device: torch.device) -> str | None:
        """The cached per-device verdict (policy, then the probe of the real call); ``None``: FP8 can run."""
        try:
            return self.device_reasons[device]
        except KeyError:
            reason = fp8_linear_fallback_reason(device, use_fast_accum=self.options.use_fast_accum)
            self.device_reasons[device] = reason
            return reason

    def allow_device(self, device: torch.device) -> str | None:
        """Let the FP8 path run on ``device`` although the policy skips it (CPU verification runs, tests), if
        the real ``torch._scaled_mm`` call works there.

        Args:
            device: e.g. ``torch.device("cpu")``.

        Returns:
            The probe's verdict, now the device's fallback reason: ``None`` when FP8 will run there, else the
            reason every call on that device records.
        """
        reason = rowwise_scaled_mm_unavailable_reason(device, use_fast_accum=self.options.use_fast_accum)
        self.device_reasons[device] = reason
        return reason

    def make_wrapper(self, path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The ``make_wrapper`` handed to :meth:`PatchRecorder.wrap_forward` for ``path``."""
        target = self.targets[path]

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(input: torch.Tensor) -> torch.Tensor:
                self.guard.verify(path)
                reason = self.fallback_reason(target, input)
                if reason is not None:
                    self.ledger.fallback(path, reason)
                    return original(input)
                return self._fp8_forward(target, input)

            return forward

        return make

    # ------------------------------------------------------------------ per call
    def fallback_reason(self, target: _Target, x: torch.Tensor) -> str | None:
        """Why this call runs the dense Linear (``None``: it runs FP8)."""
        k = target.in_features
        rows = x.numel() // k if x.dim() >= 1 and x.shape[-1] == k else 0
        return self.call_reason(target, x.device, x.dtype, rows, x.requires_grad)

    def call_reason(self, target: _Target, device: torch.device, dtype: torch.dtype, rows: int,
                    requires_grad: bool) -> str | None:
        """:meth:`fallback_reason` for an input described by its device, dtype, row count and grad flag."""
        reason = self.device_reason(device)
        if reason is not None:
            return reason
        if device != target.weight.qweight.device:
            return REASON_OTHER_DEVICE
        if dtype != torch.bfloat16 or target.linear.weight.dtype != torch.bfloat16:
            return REASON_DTYPE
        if rows == 0 or rows < self.options.min_tokens:
            return REASON_FEW_ROWS
        if torch.is_grad_enabled() and (requires_grad or target.linear.weight.requires_grad):
            return REASON_AUTOGRAD
        return None

    def _fp8_forward(self, target: _Target, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = self.fp8_matmul(target, x.reshape(-1, target.in_features))
        return out.reshape(*lead, target.out_features)

    def fp8_matmul(self, target: _Target, rows_in: torch.Tensor) -> torch.Tensor:
        """FP8 Linear of ``[M, K]`` rows: activation quantization + ``torch._scaled_mm`` + bias, recorded."""
        rows = quantize_activations_rowwise_fp8(rows_in, clip_counter=self.clip_counter(target.path, rows_in.device))
        if rows.fallback_reason is not None:
            self.ledger.count(QUANT_REFERENCE_COUNTER)
        out = scaled_mm_rowwise(
            rows.q, rows.scale, target.weight, target.linear.bias,
            out_dtype=torch.bfloat16, use_fast_accum=self.options.use_fast_accum,
        )
        self.ledger.executed(target.path, EXECUTED_KIND)
        return out

    def clip_counter(self, path: str, device: torch.device) -> torch.Tensor:
        """The device-side clip counter of ``path`` (created on first use)."""
        counter = self._clip_counters.get(path)
        if counter is None or counter.device != device:
            # a normal tensor even when created under inference_mode, so flush_clips can reset it anywhere
            with self._clip_lock, torch.inference_mode(False):
                counter = torch.zeros(1, dtype=torch.int32, device=device)
                self._clip_counters[path] = counter
        return counter

    # ------------------------------------------------------------------ clipping diagnostics
    def flush_clips(self) -> dict[str, int]:
        """Read and reset the device-side clip counters (synchronises with the device once).

        Returns:
            ``{path: clipped elements}`` for the modules with a non-zero count since the last flush.
        """
        with self._clip_lock:
            counters = dict(self._clip_counters)
        if not counters:
            return {}
        paths = list(counters)
        values = torch.stack([counters[p].reshape(()).to("cpu", torch.int64) for p in paths]).tolist()
        for counter in counters.values():
            counter.zero_()
        found = {p: int(v) for p, v in zip(paths, values, strict=True) if v}
        self.clipped_total += sum(found.values())
        return found

    def release(self) -> None:
        self.targets.clear()
        self._clip_counters.clear()
        self.device_reasons.clear()

    # ------------------------------------------------------------------ reports
    def memory(self) -> dict[str, int]:
        dense = sum(t.linear.weight.numel() * t.linear.weight.element_size() for t in self.targets.values())
        fp8 = sum(t.weight.qweight.numel() * t.weight.qweight.element_size() for t in self.targets.values())
        scales = sum(t.weight.scale.numel() * t.weight.scale.element_size() for t in self.targets.values())
        return {
            "dense_weight_bytes_retained": dense,
            "fp8_weight_bytes": fp8,
            "scale_bytes": scales,
            "extra_bytes": fp8 + scales,
        }


class SelectiveFP8Handle(RecordedHandle):
    """Handle of one ``selective_fp8`` activation: undo, clipping notes per request, execution report."""

    def __init__(self, patches: PatchRecorder, ledger: ExecutionLedger, runtime: SelectiveFP8Runtime) -> None:
        super().__init__(PLUGIN_NAME, patches, ledger)
        self.runtime = runtime
        self.paths = tuple(runtime.targets)
        self._memory = runtime.memory()

    def begin_request(self, request_id: str) -> None:
        """Counts from before the request go to the totals only."""
        self.runtime.flush_clips()

    def end_request(self, request_id: str) -> None:
        """Note the request's activation clipping count (a diagnostic, never a failure)."""
        found = self.runtime.flush_clips()
        self.ledger.note("activation_clipped_elements", sum(found.values()), request_id=request_id)
        if found:
            top = dict(sorted(found.items(), key=lambda kv: -kv[1])[:32])
            self.ledger.note("activation_clipped_by_module", top, request_id=request_id)

    def release(self) -> None:
        """Drop the FP8 weights and counters (the dense weights were never changed)."""
        self.runtime.release()

    def execution_report(self) -> dict[str, Any]:
        report = super().execution_report()
        if self.active:
            self.runtime.flush_clips()
        report["selective_fp8"] = {
            "modules": list(self.paths),
            "scaling": self.runtime.options.scaling,
            "use_fast_accum": self.runtime.options.use_fast_accum,
            "min_tokens": self.runtime.options.min_tokens,
            "memory": dict(self._memory),
            "fused_producer": {
                "kind": FUSED_KIND,
                "ffns": list(self.runtime.fused_ffns),
                "not_fused": dict(self.runtime.not_fused),
                "meaning": "FFNs whose GELU and down-projection activation quantization run as one Triton kernel; "
                           f"each fused call records '{FUSED_KIND}' on the FFN path",
            },
            "activation_clipping": {
                "elements_total": self.runtime.clipped_total,
                "threshold": CLIP_THRESHOLD,
                "meaning": "activation elements whose scaled magnitude reached the FP8 saturation threshold "
                           "(only non-finite inputs can, with per-row scales); diagnostic only",
            },
        }
        return report
