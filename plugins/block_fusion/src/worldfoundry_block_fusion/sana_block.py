"""Fused forward of diffusers 0.42's ``SanaVideoTransformerBlock`` and its linear self-attention processor.

SANA-Video runs in one dtype (bfloat16) and eager rounds after every operation, so the kernels use
``precision="per_op"``: the modulation add ``table + timestep``, ``1 + scale``, the product and the sum are each
rounded as eager rounds them.

=====================  ==============================================================  =======================
chain                  eager                                                           fused
=====================  ==============================================================  =======================
(modulation table)     ``(table[None, None] + timestep.reshape(B, T, 6, -1)).unbind(2)``  read inside the kernels
``modulate``           ``norm(x) * (1 + scale) + shift`` (and ``.to(x.dtype)``)         LayerNorm (torch) + 1
``gated_residual``     ``x + gate * attn`` / ``x + gate * ff``                          1 kernel each
``cross_residual``     ``attn2(x) + x``                                                1 kernel
``linear_attention``   ``relu`` of Q/K, rotary of both, three float casts; then         1 kernel; and 1 kernel
                       ``z = 1 / (t + 1e-15)``, ``hidden * z``, the cast
``glu``                the feed-forward's ``h * silu(gate)`` over the chunked halves     1 kernel
                       of ``conv_depth``'s output (:mod:`.sana_ffn`)
=====================  ==============================================================  =======================

A chain whose operands do not fit (a non-contiguous residual stream: the first block receives the patch embedding's
transposed view; mixed dtypes) runs eager's torch expression and is counted as a fallback of that chain.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

import torch
import torch.nn as nn
import torch.nn.functional as F

from worldfoundry.core.acceleration.context import current_request_id
from worldfoundry.core.fusion.adaln import gated_residual, modulate, residual_add
from worldfoundry.core.fusion.launch import precompile
from worldfoundry.core.fusion.rope import sana_normalize, sana_relu_rope
from worldfoundry.core.fusion.triton_support import unavailable_reason
from worldfoundry_block_fusion.eligibility import REASON_GRAD, modulation_reason, rotary_reason, stream_reason
from worldfoundry_block_fusion.handle import (
    CROSS_RESIDUAL,
    GATED_RESIDUAL,
    GLU,
    LINEAR_ATTENTION,
    MODULATE,
    BlockCounts,
    FusionCounters,
)
from worldfoundry_block_fusion.kernel_warmup import REASON_COMPILING, KernelWarmup
from worldfoundry_block_fusion.sana_ffn import make_ff_forward, precompile_glu

logger = logging.getLogger(__name__)

REASON_MIXED: Final = "operands of different dtypes"
REASON_STRIDED: Final = "non-contiguous residual stream"


class SanaBlockRuntime:
    """State shared by the fused SANA-Video blocks of one model."""

    def __init__(self, counters: FusionCounters, chains: tuple[str, ...], min_tokens: int) -> None:
        self.counters = counters
        self.min_tokens = min_tokens
        self.modulate = "modulate" in chains
        self.gate = "gated_residual" in chains
        self.cross = "cross_residual" in chains
        self.linear_attention = "linear_attention" in chains
        self.glu = "glu" in chains
        self._counts: dict[str, BlockCounts] = {}
        #: the kernel variants a block needs were recorded and their compilation started (see :attr:`kernels`)
        self.precompiled = False
        #: compiles the recorded variants, now or in the background (set from the options at activation)
        self.kernels = KernelWarmup()

    def block_counts(self, path: str) -> BlockCounts:
        """The plain counters of the block at ``path`` (one per block, shared by its forward, processor and FFN)."""
        counts = self._counts.get(path)
        if counts is None:
            counts = self._counts[path] = self.counters.block(path)
        return counts

    @staticmethod
    def glu_fused(counts: list[int]) -> None:
        counts[GLU] += 1

    def make_ff_forward(self, ff: nn.Module, path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The wrapper factory of the block's feed-forward (``GLUMBTempConv``) forward (the ``glu`` chain)."""
        return make_ff_forward(self, ff, path)

    def make_block_forward(self, block: nn.Module, path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        counts = self.block_counts(path)

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        encoder_hidden_states: torch.Tensor | None = None,
                        encoder_attention_mask: torch.Tensor | None = None, timestep: torch.LongTensor | None = None,
                        frames: int = None, height: int = None, width: int = None,
                        rotary_emb: torch.Tensor | None = None) -> torch.Tensor:
                reason = stream_reason(hidden_states, self.min_tokens, contiguous=False)
                emb = None
                if reason is None:
                    if timestep is None or timestep.dim() != 3:
                        reason = "timestep embedding is not [B, T, 6 * C]"
                    else:
                        emb = timestep.reshape(hidden_states.shape[0], timestep.shape[1], 6, -1)
                        reason = modulation_reason(hidden_states, block.scale_shift_table, emb)
                    if reason is None and not (hidden_states.dtype == block.scale_shift_table.dtype == emb.dtype):
                        reason = REASON_MIXED
                if reason is not None:
                    self.kernels.seen = True
                    self.counters.fallback(path, reason)
                    return original(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                    timestep, frames, height, width, rotary_emb)
                rid = current_request_id()
                if rid != counts.rid:
                    self.counters.switch(counts, rid)
                if not self.precompiled:
                    self.precompile(block, hidden_states, emb, rotary_emb, frames, height, width)
                if self.kernels.pending():
                    self.counters.fallback(path, REASON_COMPILING)
                    return original(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                    timestep, frames, height, width, rotary_emb)
                return self.block_forward(block, path, counts.counts, hidden_states, encoder_hidden_states,
                                          encoder_attention_mask, emb, frames, height, width, rotary_emb)

            return forward

        return make

    def precompile(self, block: nn.Module, x: torch.Tensor, emb: torch.Tensor, rotary_emb: Any,
                   frames: int | None = None, height: int | None = None, width: int | None = None) -> None:
        """Record the kernel variants of :meth:`block_forward` and the processor and have :attr:`kernels` compile
        them (concurrently; before this call goes on, or in the background -- ``kernel_compile``).

        The fused calls are issued on uninitialised contiguous tensors of the geometry the block's own calls will
        have (:func:`~worldfoundry.core.fusion.launch.precompile` records them instead of launching). Nothing is
        counted; a failure is logged and leaves compilation to first use.
        """
        self.precompiled = True
        table = block.scale_shift_table
        bsz, s, c = x.shape
        like = torch.empty((bsz, s, c), dtype=x.dtype, device=x.device)
        try:
            with precompile(compile_now=False) as jobs:
                if self.modulate:
                    modulate(like, table, emb, 0, 1, out_dtype=x.dtype, precision="per_op")
                if self.gate:
                    gated_residual(like, like, table, emb, 2, precision="per_op")
                if self.cross and getattr(block, "attn2", None) is not None:
                    residual_add(like, like)
                    if not x.is_contiguous():  # the first block's stream (an eager gate keeps its layout)
                        residual_add(like, x)
                heads = getattr(getattr(block, "attn1", None), "heads", None)
                if self.linear_attention and heads and c % heads == 0:
                    q = torch.empty((bsz, s, heads, c // heads), dtype=x.dtype, device=x.device)
                    if rotary_reason(q, rotary_emb) is None:
                        sana_relu_rope(q, q, q, *rotary_emb)
                        hidden = torch.empty((bsz, heads, c // heads, s), dtype=torch.float32, device=x.device)
                        denom = torch.empty((bsz, heads, 1, s), dtype=x.dtype, device=x.device)
                        sana_normalize(hidden, denom, x.dtype)
                if self.glu and getattr(block, "ff", None) is not None:
                    precompile_glu(block.ff, x, frames, height, width, self.min_tokens)
        except Exception as exc:  # noqa: BLE001 - precompilation is an optimisation only
            logger.warning("block_fusion: precompiling the kernels failed (%s: %s); they compile on first use",
                           type(exc).__name__, exc)
            return
        self.kernels.start(jobs)

    def block_forward(self, block: nn.Module, path: str, counts: list[int], x: torch.Tensor,
                      encoder_hidden_states: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None, emb: torch.Tensor, frames: int, height: int,
                      width: int, rotary_emb: Any) -> torch.Tensor:
        """The block's forward with fused pointwise chains (the checks of :meth:`make_block_forward` passed)."""
        table = block.scale_shift_table
        mods: list[torch.Tensor] = []

        def eager_mods() -> list[torch.Tensor]:
            if not mods:
                mods.extend((table[None, None] + emb).unbind(dim=2))
            return mods

        # 2. self-attention
        n = block.norm1(x)
        h = self._modulate(n, table, emb, 0, 1, eager_mods, path, counts).to(x.dtype)
        attn = block.attn1(h, rotary_emb=rotary_emb)
        x = self._gate(x, attn, table, emb, 2, eager_mods, path, counts)
        # 3. cross-attention
        if block.attn2 is not None:
            attn = block.attn2(x, encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask)
            if self.cross and attn.is_contiguous() and attn.dtype == x.dtype and attn.shape == x.shape:
                x = residual_add(attn, x)[0]
                counts[CROSS_RESIDUAL] += 1
            else:
                if self.cross:
                    self.counters.fallback(path, "cross_residual: " + REASON_STRIDED)
                x = attn + x
        # 4. feed-forward
        n = block.norm2(x)
        h = self._modulate(n, table, emb, 3, 4, eager_mods, path, counts)
        h = h.unflatten(1, (frames, height, width))
        ff = block.ff(h)
        ff = ff.flatten(1, 3)
        return self._gate(x, ff, table, emb, 5, eager_mods, path, counts)

    def _modulate(self, n: torch.Tensor, table: torch.Tensor, emb: torch.Tensor, k_shift: int, k_scale: int,
                  eager_mods: Callable[[], list[torch.Tensor]], path: str, counts: list[int]) -> torch.Tensor:
        if self.modulate and n.is_contiguous() and n.dtype == table.dtype:
            counts[MODULATE] += 1
            return modulate(n, table, emb, k_shift, k_scale, out_dtype=n.dtype, precision="per_op")[0]
        if self.modulate:
            self.counters.fallback(path, "modulate: " + (REASON_MIXED if n.dtype != table.dtype else REASON_STRIDED))
        m = eager_mods()
        return n * (1 + m[k_scale]) + m[k_shift]

    def _gate(self, x: torch.Tensor, y: torch.Tensor, table: torch.Tensor, emb: torch.Tensor, k: int,
              eager_mods: Callable[[], list[torch.Tensor]], path: str, counts: list[int]) -> torch.Tensor:
        if self.gate and x.is_contiguous() and y.dtype == x.dtype and y.shape == x.shape:
            counts[GATED_RESIDUAL] += 1
            return gated_residual(x, y, table, emb, k, precision="per_op")[0]
        if self.gate:
            self.counters.fallback(path, "gated_residual: " + (REASON_STRIDED if not x.is_contiguous()
                                                               else REASON_MIXED))
        return x + eager_mods()[k] * y

    def make_processor(self, original: Any, path: str) -> SanaFusedLinearAttnProcessor:
        return SanaFusedLinearAttnProcessor(original, self, path)


class SanaFusedLinearAttnProcessor:
    """``SanaLinearAttnProcessor3_0`` with its pointwise chains as two kernel launches (projections, norms, the
    key sum and the three matmuls are the processor's own torch calls)."""

    def __init__(self, original: Any, runtime: SanaBlockRuntime, path: str) -> None:
        self.original = original
        self.runtime = runtime
        self.path = path
        self.counts = runtime.block_counts(path)

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: torch.Tensor | None = None) -> torch.Tensor:
        if self.runtime.kernels.pending():  # the block's fallback counted it
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        reason = self._reason(hidden_states, encoder_hidden_states, rotary_emb)
        if reason is not None:
            self.runtime.counters.fallback(self.path, "linear_attention: " + reason)
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        original_dtype = hidden_states.dtype
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if (rotary_reason(query, rotary_emb) is not None or key.shape != query.shape
                or value.shape != query.shape or query.dtype not in (torch.bfloat16, torch.float32)):
            self.runtime.counters.fallback(self.path, "linear_attention: Q/K/V or rotary layout")
            return _eager_tail(attn, query, key, value, rotary_emb, original_dtype)
        dense_value = value.is_contiguous() and query.is_contiguous()
        query, key, query_rotate, key_rotate, value_float = sana_relu_rope(
            query, key, value if dense_value else None, *rotary_emb)
        query = query.permute(0, 2, 3, 1)
        key = key.permute(0, 2, 3, 1)
        query_rotate = query_rotate.permute(0, 2, 3, 1)
        key_rotate = key_rotate.permute(0, 2, 3, 1)
        value = value_float.permute(0, 2, 3, 1) if dense_value else value.permute(0, 2, 3, 1).float()
        denom = key.sum(dim=-1, keepdim=True).transpose(-2, -1) @ query
        scores = torch.matmul(value, key_rotate.transpose(-1, -2))
        hidden_states = torch.matmul(scores, query_rotate)
        if (hidden_states.is_contiguous() and denom.is_contiguous() and hidden_states.dtype == torch.float32
                and denom.dtype in (torch.bfloat16, torch.float32) and original_dtype in (torch.bfloat16,
                                                                                         torch.float32)):
            hidden_states = sana_normalize(hidden_states, denom, original_dtype)
            hidden_states = hidden_states.flatten(1, 2).transpose(1, 2)
            counts = self.counts
            rid = current_request_id()
            if rid != counts.rid:
                self.runtime.counters.switch(counts, rid)
            counts.counts[LINEAR_ATTENTION] += 1
        else:
            self.runtime.counters.fallback(self.path, "linear_attention: normalisation layout")
            hidden_states = (hidden_states * (1 / (denom + 1e-15))).flatten(1, 2).transpose(1, 2).to(original_dtype)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states

    def _reason(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None,
                rotary_emb: Any) -> str | None:
        if encoder_hidden_states is not None:
            return "encoder_hidden_states given"
        if rotary_emb is None:
            return "no rotary embedding"
        if torch.is_grad_enabled():
            return REASON_GRAD
        return unavailable_reason(hidden_states)


def _eager_tail(attn: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rotary_emb: Any,
                original_dtype: torch.dtype) -> torch.Tensor:
    """The processor's code after the Q/K/V unflatten, as eager runs it."""
    from worldfoundry.core.fusion.rope import reference_rope

    query = F.relu(query)
    key = F.relu(key)
    query_rotate = reference_rope(query, *rotary_emb)
    key_rotate = reference_rope(key, *rotary_emb)
    query = query.permute(0, 2, 3, 1)
    key = key.permute(0, 2, 3, 1)
    query_rotate = query_rotate.permute(0, 2, 3, 1)
    key_rotate = key_rotate.permute(0, 2, 3, 1)
    value = value.permute(0, 2, 3, 1)
    query_rotate, key_rotate, value = query_rotate.float(), key_rotate.float(), value.float()
    z = 1 / (key.sum(dim=-1, keepdim=True).transpose(-2, -1) @ query + 1e-15)
    scores = torch.matmul(value, key_rotate.transpose(-1, -2))
    hidden_states = torch.matmul(scores, query_rotate)
    hidden_states = hidden_states * z
    hidden_states = hidden_states.flatten(1, 2).transpose(1, 2)
    hidden_states = hidden_states.to(original_dtype)
    hidden_states = attn.to_out[0](hidden_states)
    return attn.to_out[1](hidden_states)


__all__ = ["SanaBlockRuntime", "SanaFusedLinearAttnProcessor"]
