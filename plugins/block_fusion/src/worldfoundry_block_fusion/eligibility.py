"""Runtime checks shared by the fused block forwards: may this call take the kernel path, and if not, why."""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any, Final

import torch
import torch.nn as nn
from torch.nn.modules import module as _module_globals

from worldfoundry.core.fusion.layer_norm import MAX_N as LN_MAX_N
from worldfoundry.core.fusion.layer_norm import VEC as LN_VEC
from worldfoundry.core.fusion.triton_support import SUPPORTED_DTYPES, unavailable_reason

REASON_GRAD: Final = "grad mode enabled (the kernels are inference-only; run under torch.no_grad()/inference_mode())"
REASON_DTYPE: Final = "hidden_states dtype is not bfloat16/float32"
REASON_LAYOUT: Final = "hidden_states is not a contiguous [B, S, C] tensor"
REASON_TOKENS: Final = "fewer tokens than min_tokens"
REASON_TEMB: Final = "timestep embedding layout not [B, 6, C] / [B, T, 6, C] with T in (1, S)"
REASON_TABLE: Final = "scale_shift_table is not a floating [.., 6, C] tensor"
REASON_NORM_DEVICE: Final = ("layer_norm: cpu tensor (the kernel reproduces PyTorch's CUDA LayerNorm; the CPU runs "
                              "another algorithm)")
#: Devices whose PyTorch LayerNorm is the algorithm :mod:`worldfoundry.core.fusion.layer_norm` reproduces.
NORM_DEVICES: tuple[str, ...] = ("cuda",)
REASON_ROTARY: Final = "rotary embedding is not a (cos, sin) pair of [1|B, S, 1, D] float tensors"


def stream_reason(x: torch.Tensor, min_tokens: int, *, contiguous: bool = True) -> str | None:
    """Why the residual stream ``x`` cannot take the fused path (``None`` when it can).

    Args:
        x: the block's ``hidden_states``.
        min_tokens: the option of that name.
        contiguous: also require a contiguous ``[B, S, C]`` layout (otherwise only ``[B, S, C]``).
    """
    if torch.is_grad_enabled():
        return REASON_GRAD
    device = unavailable_reason(x)
    if device is not None:
        return device
    if x.dtype not in SUPPORTED_DTYPES:
        return REASON_DTYPE
    if x.dim() != 3 or (contiguous and not x.is_contiguous()):
        return REASON_LAYOUT
    if x.shape[1] < min_tokens:
        return REASON_TOKENS
    return None


def modulation_reason(x: torch.Tensor, table: torch.Tensor, emb: torch.Tensor) -> str | None:
    """Why ``table`` ([6, C] view) and ``emb`` ([B, 6, C] or [B, T, 6, C]) cannot feed the AdaLN kernels."""
    return table_reason(x, table) or temb_reason(x, emb)


def table_reason(x: torch.Tensor, table: torch.Tensor) -> str | None:
    """The ``table`` half of :func:`modulation_reason` (a block's own parameter: checked once per block)."""
    if not table.is_floating_point() or table.shape != (6, x.shape[-1]) or table.device != x.device:
        return REASON_TABLE
    return None


def temb_reason(x: torch.Tensor, emb: torch.Tensor) -> str | None:
    """The ``emb`` half of :func:`modulation_reason` (one tensor serves every block of a forward)."""
    c = x.shape[-1]
    if not emb.is_floating_point() or emb.device != x.device or emb.shape[-2:] != (6, c):
        return REASON_TEMB
    if emb.dim() == 3:
        return None if emb.shape[0] == x.shape[0] else REASON_TEMB
    if emb.dim() == 4 and emb.shape[0] == x.shape[0] and emb.shape[1] in (1, x.shape[1]):
        return None
    return REASON_TEMB


def rotary_reason(query: torch.Tensor, rotary_emb: Any) -> str | None:
    """Why ``rotary_emb`` cannot be applied to ``query`` ([B, S, H, D]) by the rotary kernel."""
    if not isinstance(rotary_emb, Sequence) or len(rotary_emb) != 2:
        return REASON_ROTARY
    cos, sin = rotary_emb
    if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
        return REASON_ROTARY
    b, s, _, d = query.shape
    if (cos.dim() != 4 or cos.shape != sin.shape or cos.stride() != sin.stride() or cos.dtype != sin.dtype
            or cos.dtype not in (torch.float32, torch.float64, torch.bfloat16) or cos.shape[0] not in (1, b) or cos.shape[1] != s
            or cos.shape[2] != 1 or cos.shape[3] != d or d % 2 or cos.device != query.device):
        return REASON_ROTARY
    if query.dtype not in SUPPORTED_DTYPES:
        return "query dtype is not bfloat16/float32"
    return None


def norm_reason(norm: nn.Module, x: torch.Tensor, *, affine: bool) -> str | None:
    """Why the reproduced LayerNorm kernel cannot stand in for ``norm(x.float())`` here (``None`` when it can).

    ``norm`` must be diffusers' ``FP32LayerNorm`` (or ``nn.LayerNorm`` with float32 parameters) over the last
    dimension, unwrapped and unhooked (nothing would run that eager runs), with (``affine``) or without weight and
    bias, on a device whose PyTorch LayerNorm is the reproduced algorithm (:data:`NORM_DEVICES`), and PyTorch must be
    about to take its vectorized kernel (:func:`~worldfoundry.core.fusion.layer_norm.torch_path_reason`): width a
    multiple of 4 up to 2^24, the float32 operands eager hands it 16-byte aligned. Those operands are the stream
    (a fresh copy unless it is float32 already) and ``weight.float()`` / ``bias.float()`` (fresh unless float32).
    The hot path splits this into :func:`stream_norm_reason` (once per call), :func:`norm_module_reason` (static,
    cacheable) and :func:`norm_hooked` (every call).
    """
    return (stream_norm_reason(x) or norm_module_reason(norm, x.shape[-1], affine=affine)
            or ("layer_norm: the norm module is wrapped or hooked (it runs as a module)" if norm_hooked(norm)
                else None))


def stream_norm_reason(x: torch.Tensor) -> str | None:
    """The stream's part of :func:`norm_reason`: device, width, and a float32 stream's alignment."""
    if ("cuda" if x.is_cuda else x.device.type) not in NORM_DEVICES:
        return REASON_NORM_DEVICE
    n = x.shape[-1]
    if n % LN_VEC or n > LN_MAX_N:
        return f"layer_norm: width {n} (PyTorch's vectorized kernel needs a multiple of 4 up to 2^24)"
    if x.dtype == torch.float32 and x.data_ptr() % (LN_VEC * 4):
        return "layer_norm: float32 stream not 16-byte aligned (PyTorch takes another kernel)"
    return None


def norm_module_reason(norm: nn.Module, n: int, *, affine: bool) -> str | None:
    """The module's static part of :func:`norm_reason`: class, normalized shape, parameters and their alignment."""
    if type(norm) not in _layer_norm_types():
        return f"layer_norm: {type(norm).__name__} is not FP32LayerNorm / LayerNorm"
    params = norm._parameters
    weight, bias = params.get("weight"), params.get("bias")
    if tuple(norm.normalized_shape) != (n,) or (weight is not None) != affine or (bias is not None) != affine:
        return "layer_norm: normalized shape or affine parameters not as Wan's"
    if type(norm) is nn.LayerNorm and weight is not None and weight.dtype != torch.float32:
        return "layer_norm: LayerNorm parameters not float32"
    for t in (weight, bias):
        if t is not None and t.dtype == torch.float32 and (t.data_ptr() % (LN_VEC * 4) or not t.is_contiguous()):
            return "layer_norm: float32 weight or bias not contiguous and 16-byte aligned"
    return None


def norm_hooked(norm: nn.Module, global_hooks: bool | None = None) -> bool:
    """Whether calling ``norm`` would run something besides its class's forward (a wrapper, a hook of its own, or a
    process-wide module hook; ``global_hooks`` when the caller already knows whether there is one)."""
    if global_hooks is None:
        global_hooks = not no_global_hooks()
    return bool(global_hooks or "forward" in norm.__dict__ or norm._forward_hooks or norm._forward_pre_hooks)


@functools.cache
def _layer_norm_types() -> tuple[type, ...]:
    from diffusers.models.normalization import FP32LayerNorm

    return (FP32LayerNorm, nn.LayerNorm)


def no_global_hooks() -> bool:
    """No process-wide module forward hooks (they would run between blocks)."""
    return not (_module_globals._global_forward_hooks or _module_globals._global_forward_pre_hooks)


class FloatCarry:
    """Hands the float32 value of a block's output to the next block's LayerNorm (per thread).

    Valid only when the next block receives the very tensor the previous block returned, unchanged (same object,
    same version counter where it has one), and no hook can run in between (none on either block, none global).
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def put(self, x: torch.Tensor, x_float: torch.Tensor, producer: nn.Module, consumer: nn.Module | None) -> None:
        if consumer is None:
            self._local.value = None
            return
        version = None if x.is_inference() else x._version
        self._local.value = (x, x_float, version, producer, consumer)

    def take(self, x: torch.Tensor, consumer: nn.Module) -> torch.Tensor | None:
        value = getattr(self._local, "value", None)
        if value is None:
            return None
        self._local.value = None
        held, x_float, version, producer, expected = value
        if held is not x or expected is not consumer:
            return None
        if version is not None and x._version != version:
            return None
        if producer._forward_hooks or consumer._forward_pre_hooks or not no_global_hooks():
            return None
        return x_float

    def clear(self) -> None:
        self._local.value = None


__all__ = [
    "REASON_GRAD",
    "REASON_LAYOUT",
    "REASON_ROTARY",
    "REASON_TEMB",
    "REASON_TOKENS",
    "FloatCarry",
    "modulation_reason",
    "no_global_hooks",
    "norm_hooked",
    "norm_module_reason",
    "norm_reason",
    "stream_norm_reason",
    "rotary_reason",
    "stream_reason",
    "table_reason",
    "temb_reason",
]
