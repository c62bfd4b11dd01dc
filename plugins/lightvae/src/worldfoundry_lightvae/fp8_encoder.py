"""Activation of the FP8 student encoder: recorded ``_conv_forward`` patches, counters and clipping diagnostics.

Each selected ``WanCausalConv3d`` keeps diffusers' causal padding and feature cache; only the convolution
itself (``Conv3d._conv_forward`` of the padded input) is replaced by the FP8 implicit GEMM (or its torch
reference, or — where no FP8 GEMM exists — the original convolution with a recorded fallback).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch import nn

from worldfoundry.base_models.diffusion_model.codec_fp8 import BoundConvolution
from worldfoundry.core.acceleration.quantization.fp8_conv import (
    PackedFp8Conv,
    activation_scale,
    count_clipped,
    fp8_conv3d,
    fp8_conv3d_reference,
    pack_conv_weight,
)
from worldfoundry.plugin import ExecutionLedger, InferenceViewError, PatchRecorder, RecordedHandle, current_request_id
from worldfoundry_lightvae.options import PLUGIN_NAME, Options

logger = logging.getLogger(__name__)

MODE_SCALED_MM: Final = "scaled_mm"
MODE_REFERENCE: Final = "reference"
MODE_FALLBACK: Final = "fallback"
_KIND: Final = {MODE_SCALED_MM: "fp8_scaled_mm", MODE_REFERENCE: "fp8_reference"}
_MAX_CLIP_REQUESTS: Final = 16


@dataclass
class _Fp8Conv:
    path: str
    module: nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None
    weight_version: int
    bias_version: int | None
    amax: torch.Tensor
    scale: torch.Tensor
    packed: PackedFp8Conv | None = None
    original: Callable[..., torch.Tensor] | None = field(default=None, repr=False)

    def check_weights(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        same = weight is self.weight and weight._version == self.weight_version and bias is self.bias
        if same and bias is not None and bias._version != self.bias_version:
            same = False
        if not same:
            raise InferenceViewError(
                f"{PLUGIN_NAME}: the weights of encoder.{self.path} changed (replaced, moved, cast or edited in place) "
                "while the FP8 encoder is installed; uninstall first, then change weights and install again"
            )


class Fp8EncoderHandle(RecordedHandle):
    """The installed FP8 encoder: undoes its patches on ``deactivate`` and drops packed weights on ``release``."""

    def __init__(self, patches: PatchRecorder, ledger: ExecutionLedger, convs: Sequence[_Fp8Conv], *, mode: str,
                 fallback_reason: str | None, options: Options) -> None:
        super().__init__(PLUGIN_NAME, patches, ledger)
        self.convs = list(convs)
        self.mode = mode
        self.fallback_reason = fallback_reason
        self.options = options
        self._clipped: dict[str, dict[str, torch.Tensor]] = {}
        self._elements: dict[str, dict[str, int]] = {}

    # ------------------------------------------------------------------ clipping diagnostics
    def record_clipping(self, path: str, x: torch.Tensor, scale: torch.Tensor) -> None:
        """Add the inputs of ``path`` beyond the calibrated range (no device sync; read at report time)."""
        rid = current_request_id()
        per = self._clipped.setdefault(rid, {})
        count = count_clipped(x, scale)
        per[path] = per[path] + count if path in per else count
        elements = self._elements.setdefault(rid, {})
        elements[path] = elements.get(path, 0) + x.numel()
        while len(self._clipped) > _MAX_CLIP_REQUESTS:
            oldest = next(iter(self._clipped))
            self._flush(oldest)

    def _flush(self, request_id: str) -> None:
        counts = self._clipped.pop(request_id, {})
        elements = self._elements.pop(request_id, {})
        if not counts:
            return
        values = {path: int(count.item()) for path, count in counts.items()}
        self.ledger.count("clipped_inputs", sum(values.values()), request_id=request_id)
        previous = (self.ledger.request_report(request_id) or {}).get("notes", {}).get("input_clipping", {})
        merged = {p: dict(v) for p, v in previous.items()}
        for path, value in values.items():
            entry = merged.setdefault(path, {"clipped": 0, "elements": 0})
            entry["clipped"] += value
            entry["elements"] += elements.get(path, 0)
        self.ledger.note("input_clipping", merged, request_id=request_id)

    def end_request(self, request_id: str) -> None:
        self._flush(request_id)
        self.ledger.finish(request_id)

    # ------------------------------------------------------------------ reports and lifecycle
    def execution_report(self) -> dict[str, Any]:
        for rid in list(self._clipped):
            self._flush(rid)
        report = super().execution_report()
        report.update({
            "backend": self.mode,
            "fallback_reason": self.fallback_reason,
            "algorithmically_approximate": True,
            "convolutions": [c.path for c in self.convs],
            "packed_weight_bytes": sum(c.packed.nbytes() for c in self.convs if c.packed is not None),
            "count_clipping": self.options.count_clipping,
        })
        return report

    def release(self) -> None:
        for conv in self.convs:
            conv.packed = None
            conv.original = None
        self._clipped.clear()
        self._elements.clear()


def _make_forward(handle_ref: list[Fp8EncoderHandle], conv: _Fp8Conv, mode: str, reason: str | None,
                  options: Options) -> Callable[..., torch.Tensor]:
    workspace = options.workspace_mb << 20
    kind = _KIND.get(mode, "")

    def fp8_conv_forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        handle = handle_ref[0]
        conv.check_weights(weight, bias)
        original = conv.original
        if original is None:
            raise InferenceViewError(f"{PLUGIN_NAME}: encoder.{conv.path} was released; this forward is stale")
        if mode == MODE_FALLBACK or conv.packed is None:
            handle.ledger.fallback(conv.path, reason or "no FP8 weight packed")
            return original(input, weight, bias)
        if options.count_clipping:
            handle.record_clipping(conv.path, input, conv.scale)
        if mode == MODE_SCALED_MM:
            out = fp8_conv3d(input, conv.packed, conv.scale, workspace_bytes=workspace)
        else:
            out = fp8_conv3d_reference(input, conv.packed, conv.scale)
        handle.ledger.executed(conv.path, kind)
        return out

    return fp8_conv_forward


def activate_fp8_encoder(bound: Sequence[BoundConvolution], options: Options, *, mode: str,
                         fallback_reason: str | None) -> Fp8EncoderHandle:
    """Pack the selected weights and patch each convolution's ``_conv_forward`` (recorded, reversible).

    Returns:
        The handle; ``deactivate()`` restores every convolution exactly.
    """
    ledger = ExecutionLedger(PLUGIN_NAME)
    convs: list[_Fp8Conv] = []
    handle_ref: list[Fp8EncoderHandle] = []
    with PatchRecorder(PLUGIN_NAME) as rec:
        for entry in bound:
            module = entry.module
            weight, bias = module.weight, module.bias
            device = weight.device
            conv = _Fp8Conv(
                path=entry.relative_path,
                module=module,
                weight=weight,
                bias=bias,
                weight_version=weight._version,
                bias_version=bias._version if bias is not None else None,
                amax=torch.tensor(entry.amax, dtype=torch.float32, device=device),
                scale=torch.tensor(activation_scale(entry.amax), dtype=torch.float32, device=device),
                packed=pack_conv_weight(module) if mode != MODE_FALLBACK else None,
                original=module._conv_forward,
            )
            forward = _make_forward(handle_ref, conv, mode, fallback_reason, options)
            functools.update_wrapper(forward, module._conv_forward)  # keeps the signature and name
            rec.setattr(module, "_conv_forward", forward)
            convs.append(conv)
        handle = Fp8EncoderHandle(rec.pop_all(), ledger, convs, mode=mode, fallback_reason=fallback_reason,
                                  options=options)
    handle_ref.append(handle)
    logger.info("lightvae FP8 encoder active on %d convolution(s), backend %s", len(convs), mode)
    return handle


__all__ = ["MODE_FALLBACK", "MODE_REFERENCE", "MODE_SCALED_MM", "Fp8EncoderHandle", "activate_fp8_encoder"]
