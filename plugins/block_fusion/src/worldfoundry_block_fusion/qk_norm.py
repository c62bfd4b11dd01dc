"""The ``qk_norm`` chain: Wan's across-heads RMSNorm of Q and K inside the rotary launch.

With ``rope`` alone the fused self-attention runs ``norm_q`` and ``norm_k`` (two PyTorch RMSNorm kernels, two
module calls) and then one rotary launch for both; with ``qk_norm`` it is one launch for all of it
(:func:`~worldfoundry.core.fusion.qk_norm_rope.rms_norm_rope_qk`, PyTorch's CUDA RMSNorm reduction reproduced
bitwise). :class:`QKNormCheck` decides per call whether that launch may stand in for eager and otherwise says why
(the processor then runs the norms as modules and counts a ``qk_norm`` fallback with the reason):

* both norms plain ``nn.RMSNorm`` (that class, no wrapper, no hook of their own, no process-wide module hook) with
  a weight and an explicit ``eps``, over the full width;
* a device whose PyTorch RMSNorm is the reproduced CUDA algorithm (:data:`QK_NORM_DEVICES`);
* the operands within the kernel's scope and on PyTorch's vectorized path
  (:func:`~worldfoundry.core.fusion.qk_norm_rope.reason`).

The module and operand checks are remembered per processor while the norms, their weights (objects and
addresses), the frequencies (objects) and the Q geometry stay the same; hooks and the per-call layout of Q and K
are checked on every call. Chunks of a fused Q/K/V projection (``optimized_mha``, diffusers'
``fuse_projections``) are read in place: eager's RMSNorm copies them to contiguous tensors first, which changes
no value.
"""

from __future__ import annotations

from typing import Any, Final

import torch
import torch.nn as nn

from worldfoundry.core.fusion.qk_norm_rope import reason as kernel_reason
from worldfoundry.core.fusion.qk_norm_rope import row_stride
from worldfoundry_block_fusion.eligibility import no_global_hooks

REASON_QK_DEVICE: Final = ("qk_norm: cpu tensor (the kernel reproduces PyTorch's CUDA RMSNorm; the CPU runs another "
                           "algorithm)")
#: Devices whose PyTorch RMSNorm is the algorithm :mod:`worldfoundry.core.fusion.qk_norm_rope` reproduces.
QK_NORM_DEVICES: tuple[str, ...] = ("cuda",)


def _plain(module: nn.Module) -> bool:
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def norm_modules_reason(norm_q: nn.Module, norm_k: nn.Module, width: int) -> str | None:
    """Why ``norm_q``/``norm_k`` are not the plain full-width ``nn.RMSNorm`` pair the kernel reproduces."""
    for name, norm in (("norm_q", norm_q), ("norm_k", norm_k)):
        if type(norm) is not nn.RMSNorm:
            return f"qk_norm: {name} is {type(norm).__name__}, not torch.nn.RMSNorm"
        if norm._parameters.get("weight") is None or norm.eps is None:
            return f"qk_norm: {name} has no weight or no explicit eps"
        if tuple(norm.normalized_shape) != (width,):
            return f"qk_norm: {name} normalises {tuple(norm.normalized_shape)}, not the full width {width}"
    return None


class QKNormCheck:
    """Per-processor memory of the last operands found eligible (module docs)."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: tuple[Any, ...] | None = None

    def reason(self, attn: nn.Module, query: torch.Tensor, key: torch.Tensor, rotary_emb: Any) -> str | None:
        norm_q, norm_k = attn.norm_q, attn.norm_k
        if not (no_global_hooks() and _plain(norm_q) and _plain(norm_k)):
            return "qk_norm: a norm is wrapped or hooked (it runs as a module)"
        if key.shape != query.shape or row_stride(query) is None or row_stride(key) is None:
            return "qk_norm: query and key are not [B, S, C] rows of contiguous channels of one shape"
        held = self._held
        if (held is not None and type(rotary_emb) is tuple and len(rotary_emb) == 2 and held[0] is norm_q
                and held[1] is norm_k and held[2] is norm_q.weight and held[3] is norm_k.weight
                and held[4] == (norm_q.weight.data_ptr(), norm_k.weight.data_ptr(), norm_q.eps, norm_k.eps)
                and held[5] is rotary_emb[0] and held[6] is rotary_emb[1] and held[7] == query.shape
                and held[8] == query.dtype and held[9] == query.device and attn.heads == held[10]
                and query.data_ptr() % 16 == 0 and key.data_ptr() % 16 == 0):
            return None
        why = self._full_reason(attn, query, key, rotary_emb)
        self._held = None if why is not None else (
            norm_q, norm_k, norm_q.weight, norm_k.weight,
            (norm_q.weight.data_ptr(), norm_k.weight.data_ptr(), norm_q.eps, norm_k.eps),
            rotary_emb[0], rotary_emb[1], query.shape, query.dtype, query.device, attn.heads)
        return why

    @staticmethod
    def _full_reason(attn: nn.Module, query: torch.Tensor, key: torch.Tensor, rotary_emb: Any) -> str | None:
        if ("cuda" if query.is_cuda else query.device.type) not in QK_NORM_DEVICES:
            return REASON_QK_DEVICE
        if type(rotary_emb) is not tuple or len(rotary_emb) != 2:
            return "qk_norm: rotary embedding is not a (cos, sin) tuple"
        why = norm_modules_reason(attn.norm_q, attn.norm_k, query.shape[-1])
        if why is not None:
            return why
        why = kernel_reason(query, key, attn.norm_q.weight, attn.norm_k.weight, rotary_emb[0], rotary_emb[1],
                            attn.heads)
        return None if why is None else f"qk_norm: {why}"


__all__ = ["QK_NORM_DEVICES", "REASON_QK_DEVICE", "QKNormCheck", "norm_modules_reason"]
