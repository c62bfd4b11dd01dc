"""Run-time glue of ``svdquant``: the patched Linear forward, dense-weight placement and the handle.

Each selected Linear's forward is replaced by one that runs the SVDQuant Linear
(:func:`~worldfoundry.core.acceleration.kernels.svdquant_dispatch.svdquant_linear`) and records
``executed(path, backend)`` with ``backend`` in ``("w4f8", "w4a8", "w4a8_gluon", "w4a16", "reference",
"reference_w4f8", "reference_w4a16")`` (``w4a8_gluon``: ``w4a8`` on a Hopper GPU with a per-channel artifact); when the backend is not
the one asked for, the counter ``"backend_reason: <why>"`` says why (``"cpu device"`` on the CPU: the torch
reference of the same W4A8 numerics runs). The original dense Linear runs only for inputs that need
gradients or live on another device, recorded as ``fallback(path, reason)``; with ``keep_original: cpu``
there is no dense weight on the device, so those inputs raise instead.

``keep_original: cpu`` moves each selected weight's data to pinned host memory (the ``Parameter`` object is
kept; its ``.data`` points at the host copy) and moves it back on uninstall: the same bytes, so the state dict
and the outputs are bitwise those before install.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Final

import torch
import torch.nn as nn

from worldfoundry.base_models.diffusion_model.optimizations.guards import WeightViewGuard
from worldfoundry.core.acceleration.handle import RecordedHandle
from worldfoundry.core.acceleration.kernels.svdquant_dispatch import choose_backend, pad_rank, svdquant_linear
from worldfoundry.core.acceleration.kernels.w4f8_scaled_mm import ScaledMMWeight, prepare_scaled_mm
from worldfoundry.core.acceleration.patching import PatchRecorder
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight
from worldfoundry.core.acceleration.receipts import ExecutionLedger
from worldfoundry.errors import InferenceViewError, QuantizationInputError
from worldfoundry_svdquant.options import PLUGIN_NAME, Options

REASON_AUTOGRAD: Final = "autograd enabled"
REASON_OTHER_DEVICE: Final = "input on another device than the weight"
#: Counter prefix naming why the requested backend did not run.
BACKEND_REASON_PREFIX: Final = "backend_reason: "


class _Target:
    __slots__ = ("path", "linear", "weight", "rank", "dense_bytes", "host_copy", "scaled", "backend", "reason")

    def __init__(self, path: str, linear: nn.Linear, weight: SVDQuantWeight, rank: int) -> None:
        self.path = path
        self.linear = linear
        self.weight = weight
        self.rank = rank
        self.dense_bytes = linear.weight.numel() * linear.weight.element_size()
        self.host_copy: torch.Tensor | None = None
        self.scaled: ScaledMMWeight | None = None
        self.backend = "auto"
        self.reason: str | None = None

    @property
    def quantized_bytes(self) -> int:
        return self.weight.nbytes + (self.scaled.nbytes if self.scaled is not None else 0)


class SVDQuantRuntime:
    """State shared by the patched forwards of one activation (one model or one expert)."""

    def __init__(self, options: Options, ledger: ExecutionLedger) -> None:
        self.options = options
        self.ledger = ledger
        self.guard: WeightViewGuard | None = None
        self.targets: dict[str, _Target] = {}

    def add(self, path: str, linear: nn.Linear, weight: SVDQuantWeight) -> None:
        """Bind ``path``'s quantized weight. Where W4F8 runs, its operands are prepared now and the bfloat16
        low-rank pair is dropped from the device (the FP8 head/tail codes replace it byte for byte); a weight
        the W4F8 preparation refuses runs W4A8, and every call of it counts the reason."""
        target = _Target(path, linear, pad_rank(weight), weight.rank)
        target.backend = self.options.backend
        choice = choose_backend(weight.device, self.options.backend, weight.group_size)
        if choice.backend == "w4f8":
            try:
                target.scaled = prepare_scaled_mm(target.weight)
            except QuantizationInputError as exc:
                target.backend, target.reason = "w4a8", f"w4f8 refused: {exc}"
            else:
                target.weight = replace(target.weight, lora_down=None, lora_up=None)
                target.backend = "w4f8"
        self.targets[path] = target

    def move_dense_to_host(self, rec: PatchRecorder, path: str) -> None:
        """Move ``path``'s dense weight data to pinned host memory, recording the move back (same bytes)."""
        target = self.targets[path]
        param = target.linear.weight
        device = param.device
        pin = torch.cuda.is_available() and device.type == "cuda"
        host = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=pin)
        host.copy_(param.detach())
        param.data = host
        target.host_copy = host

        def undo() -> None:
            param.data = host.to(device)
            target.host_copy = None

        rec.callback(undo, f"move {path}.weight back to {device}")

    def make_wrapper(self, path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The ``make_wrapper`` for :meth:`PatchRecorder.wrap_forward` of ``path``."""
        target = self.targets[path]

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(input: torch.Tensor) -> torch.Tensor:
                if self.guard is not None:
                    self.guard.verify(path)
                reason = self.dense_reason(target, input)
                if reason is not None:
                    if target.host_copy is not None:
                        raise InferenceViewError(
                            f"{path}: {reason} needs the dense weight, which svdquant keeps on the host "
                            "(keep_original: cpu); uninstall first, or install with keep_original: device")
                    self.ledger.fallback(path, reason)
                    return original(input)
                out, choice = svdquant_linear(input, target.weight, target.linear.bias, backend=target.backend,
                                              scaled=target.scaled, fast_accum=self.options.fast_accum,
                                              one_launch=self.options.one_launch_operand,
                                              act_group=self.options.activation_group)
                self.ledger.executed(path, choice.backend)
                reason = choice.reason or target.reason
                if reason is not None:
                    self.ledger.count(BACKEND_REASON_PREFIX + reason)
                return out

            return forward

        return make

    def dense_reason(self, target: _Target, x: torch.Tensor) -> str | None:
        """Why ``x`` needs the dense Linear (``None`` when the quantized one runs)."""
        if x.device != target.weight.device:
            return REASON_OTHER_DEVICE
        if torch.is_grad_enabled() and x.requires_grad:
            return REASON_AUTOGRAD
        return None

    def release(self) -> None:
        self.targets.clear()

    def memory(self) -> dict[str, int]:
        """Bytes of the selected Linears' weights: dense, quantized, on the device and on the host."""
        dense = sum(t.dense_bytes for t in self.targets.values())
        quant = sum(t.quantized_bytes for t in self.targets.values())
        host = sum(t.dense_bytes for t in self.targets.values() if t.host_copy is not None)
        return {"dense_weight_bytes": dense, "quantized_bytes": quant, "dense_bytes_on_host": host,
                "weight_bytes_on_device": quant + dense - host}


class SVDQuantHandle(RecordedHandle):
    """Handle of one ``svdquant`` activation: exact undo, receipts, memory and artifact report."""

    def __init__(self, patches: PatchRecorder, ledger: ExecutionLedger, runtime: SVDQuantRuntime,
                 artifact: dict[str, Any]) -> None:
        super().__init__(PLUGIN_NAME, patches, ledger)
        self.runtime = runtime
        self.paths = tuple(runtime.targets)
        self.ranks = {p: t.rank for p, t in runtime.targets.items()}
        self._memory = runtime.memory()
        self._artifact = artifact

    def release(self) -> None:
        """Drop the quantized tensors (the dense weights are back in place)."""
        self.runtime.release()

    def execution_report(self) -> dict[str, Any]:
        report = super().execution_report()
        report["svdquant"] = {
            "modules": list(self.paths),
            "backend": self.runtime.options.backend,
            "keep_original": self.runtime.options.keep_original,
            "memory": dict(self._memory),
            "artifact": dict(self._artifact),
            "meaning": "executed kinds: w4f8 (FP8 activations, INT4 codes widened to FP8, one torch._scaled_mm with "
                       "the low-rank branch as FP8 head/tail codes), w4a8 (Triton INT8 tensor cores), w4a16 (Triton), "
                       "reference (torch, W4A8 numerics), reference_w4f8 (torch, W4F8 numerics: w4f8 asked for "
                       "off CUDA), reference_w4a16 (torch, W4A16 numerics: w4a16 asked for off CUDA); "
                       "'backend_reason: ...' counters say why the requested backend did not run",
        }
        return report
