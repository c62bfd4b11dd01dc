"""Fused forward of diffusers 0.42's ``WanTransformerBlock`` and its self-attention processor.

:meth:`WanBlockRuntime.block_forward` performs the block's computation in eager's order, calling the same
modules eager calls (``norm1``/``norm2``/``norm3``, ``attn1``, ``attn2``, ``ffn`` -- so wrappers other plugins put
on projections, norms or the FFN run as usual) and replacing only the pointwise chains between them:

=====================  ==========================================================  ===========================
chain                  eager                                                       fused
=====================  ==========================================================  ===========================
(modulation table)     ``(table + temb.float()).chunk(6, dim=1)``                   read inside the kernels
``modulate``           ``(norm1(x.float()) * (1 + scale) + shift).type_as(x)``      LayerNorm (torch) + 1 kernel
``gated_residual``     ``(x.float() + attn * gate).type_as(x)`` (and FFN's)        1 kernel
``cross_residual``     ``x + attn2(...)``                                          1 kernel
``float_carry``        ``x.float()`` before norm2, norm3 and the next norm1         written by the kernel above
``rope``               eight kernels for each of Q and K                           1 kernel for both
``qk_norm``            ``norm_q``/``norm_k`` (RMSNorm) before the rotary            inside the ``rope`` kernel
``layer_norm``         ``norm1``/``norm3`` + ``modulate``; ``norm2`` + its cast    1 kernel each
=====================  ==========================================================  ===========================

With ``layer_norm`` the LayerNorms themselves run in the fused kernels, reproducing PyTorch's CUDA LayerNorm
algorithm bitwise (:mod:`worldfoundry.core.fusion.layer_norm`) and reading the stream directly (no float32 carry
is written). A norm that is wrapped, hooked, of another class or on a device whose LayerNorm is another algorithm
runs as its module (counted as a ``layer_norm`` fallback with the reason).

A call that cannot take the fused path (CPU without Triton's interpreter, grad mode, an unsupported dtype or
layout, fewer tokens than ``min_tokens``) runs the original forward and is counted as a fallback with its reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from diffusers.models.transformers import transformer_wan

from worldfoundry.core.acceleration.context import current_request_id
from worldfoundry.core.fusion.adaln import gated_residual, modulate, residual_add
from worldfoundry.core.fusion.launch import precompile
from worldfoundry.core.fusion.layer_norm import layer_norm, layer_norm_modulate
from worldfoundry.core.fusion.qk_norm_rope import rms_norm_rope_qk
from worldfoundry.core.fusion.rope import reference_rope, rope_qk
from worldfoundry.core.fusion.triton_support import unavailable_reason
from worldfoundry_block_fusion.direct_calls import (
    attention,
    cross_attention,
    feed_forward,
    fp32_layer_norm,
    output_projection,
    qkv_projections,
    rms_norm,
    unflatten_view,
)
from worldfoundry_block_fusion.eligibility import (
    REASON_GRAD,
    REASON_TOKENS,
    FloatCarry,
    no_global_hooks,
    norm_hooked,
    norm_module_reason,
    rotary_reason,
    stream_norm_reason,
    stream_reason,
    table_reason,
    temb_reason,
)
from worldfoundry_block_fusion.kernel_warmup import REASON_COMPILING, KernelWarmup
from worldfoundry_block_fusion.qk_norm import QKNormCheck
from worldfoundry_block_fusion.handle import (
    CROSS_RESIDUAL,
    FLOAT_CARRY,
    GATED_RESIDUAL,
    LAYER_NORM,
    MODULATE,
    QK_NORM,
    ROPE,
    BlockCounts,
    FusionCounters,
)

logger = logging.getLogger(__name__)


class WanBlockRuntime:
    """State shared by the fused blocks of one model: options, counters and the float32 carry."""

    def __init__(self, counters: FusionCounters, chains: tuple[str, ...], min_tokens: int,
                 blocks: list[tuple[str, nn.Module]]) -> None:
        self.counters = counters
        self.min_tokens = min_tokens
        self.modulate = "modulate" in chains
        self.gate = "gated_residual" in chains
        self.cross = "cross_residual" in chains
        self.rope = "rope" in chains
        self.qk_norm = "qk_norm" in chains and self.rope
        self.norms = "layer_norm" in chains
        # the fused LayerNorms read the stream itself: no float32 copy of it is needed
        self.carry_enabled = "float_carry" in chains and not self.norms
        self.carry = FloatCarry()
        self._next = {id(block): (blocks[i + 1][1] if i + 1 < len(blocks) else None)
                      for i, (_, block) in enumerate(blocks)}
        self._counts: dict[str, BlockCounts] = {}
        #: (cos, sin, Q shape, dtype, device) last found eligible for the rotary kernel (held: identities stay unique)
        self.rotary_checked: tuple[Any, ...] | None = None
        #: the kernel variants a block needs were recorded and their compilation started (see :attr:`kernels`)
        self.precompiled = False
        #: compiles the recorded variants, now or in the background (set from the options at activation)
        self.kernels = KernelWarmup()
        #: id(norm) -> ((norm, weight, bias), (width, affine, id and address of weight and bias)) of norms whose
        #: static checks passed
        self.norms_checked: dict[int, tuple[tuple[Any, ...], tuple[Any, ...]]] = {}
        #: (temb, stream shape) last found eligible for the AdaLN kernels (see :meth:`modulation_reason`)
        self.temb_checked: tuple[Any, Any] = (None, None)

    # ------------------------------------------------------------------ the block
    def make_block_forward(self, block: nn.Module, path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        counts = self.counters.block(path)
        self._counts[path] = counts

        # the (table, channels, device) this block's modulation table was last found eligible for (held, so its
        # identity cannot be reused by another tensor); the temb half is checked once per forward (runtime)
        checked: list[Any] = [None, None, None]

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                        rotary_emb: torch.Tensor) -> torch.Tensor:
                table = block.scale_shift_table
                reason = stream_reason(hidden_states, self.min_tokens)
                if reason is None:
                    reason = self.modulation_reason(hidden_states, table, temb, checked)
                if reason is not None:
                    self.carry.clear()
                    self.kernels.seen = True
                    self.counters.fallback(path, reason)
                    return original(hidden_states, encoder_hidden_states, temb, rotary_emb)
                rid = current_request_id()
                if rid != counts.rid:
                    self.counters.switch(counts, rid)
                if not self.precompiled:
                    self.precompile(block, hidden_states, temb, rotary_emb, table)
                if self.kernels.pending():
                    self.carry.clear()
                    self.counters.fallback(path, REASON_COMPILING)
                    return original(hidden_states, encoder_hidden_states, temb, rotary_emb)
                norms = self.fused_norms(block, hidden_states, path) if self.norms else (False, False, False)
                return self.block_forward(block, counts.counts, hidden_states, encoder_hidden_states, temb,
                                          rotary_emb, table, norms)

            return forward

        return make

    def modulation_reason(self, x: torch.Tensor, table: torch.Tensor, temb: torch.Tensor,
                          checked: list[Any]) -> str | None:
        """:func:`~worldfoundry_block_fusion.eligibility.modulation_reason`, remembering what passed.

        The block's table is re-checked when it, the stream's channels or its device change (``checked``, per
        block); ``temb`` -- the same object for every block of a forward -- when it or the stream's shape change
        (:attr:`temb_checked`, shared by the blocks). Held references keep identities from being reused.
        """
        if not (table is checked[0] and x.shape[-1] == checked[1] and x.device == checked[2]):
            reason = table_reason(x, table[0])
            if reason is not None:
                checked[:] = (None, None, None)
                return reason
            checked[:] = (table, x.shape[-1], x.device)
        held = self.temb_checked
        if not (temb is held[0] and x.shape == held[1]):
            reason = temb_reason(x, temb)
            self.temb_checked = (temb, x.shape) if reason is None else (None, None)
            return reason
        return None

    def precompile(self, block: nn.Module, x: torch.Tensor, temb: torch.Tensor, rotary_emb: Any,
                   full_table: torch.Tensor) -> None:
        """Record the kernel variants :meth:`block_forward` will launch and have :attr:`kernels` compile them
        (concurrently; before this call goes on, or in the background -- ``kernel_compile``).

        The fused calls are issued on uninitialised tensors of the geometry the block's own calls will have
        (:func:`~worldfoundry.core.fusion.launch.precompile` records them instead of launching): the LayerNorm
        output (float32), the attention/FFN outputs and the rotary Q/K (contiguous, the stream's dtype). Nothing is
        counted; a failure is logged and leaves compilation to first use.
        """
        self.precompiled = True
        table = full_table[0]
        carry = self.carry_enabled and x.dtype != torch.float32
        like = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        try:
            with precompile(compile_now=False) as jobs:
                if self.modulate:
                    modulate(torch.empty(x.shape, dtype=torch.float32, device=x.device), table, temb, 0, 1,
                             out_dtype=x.dtype)
                if self.gate:
                    gated_residual(like, like, table, temb, 2, with_float=carry)
                if self.cross:
                    residual_add(like, like, with_float=carry)
                if self.norms:
                    self._precompile_norms(block, like, table, temb)
                self._precompile_rotary(block, x, rotary_emb)
        except Exception as exc:  # noqa: BLE001 - precompilation is an optimisation only
            logger.warning("block_fusion: precompiling the kernels failed (%s: %s); they compile on first use",
                           type(exc).__name__, exc)
            return
        self.kernels.start(jobs)

    def _precompile_rotary(self, block: nn.Module, x: torch.Tensor, rotary_emb: Any) -> None:
        """Record the rotary kernel's variant: with ``qk_norm`` the fused norms + rotary (when the self-attention's
        norms qualify), otherwise the rotary alone (see :meth:`precompile`)."""
        attn = getattr(block, "attn1", None)
        heads = getattr(attn, "heads", None)
        if not (self.rope and type(rotary_emb) is tuple and len(rotary_emb) == 2 and heads):
            return
        if self.qk_norm:
            q = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            if QKNormCheck().reason(attn, q, q, rotary_emb) is None:
                rms_norm_rope_qk(q, q, attn.norm_q.weight, attn.norm_k.weight, attn.norm_q.eps, attn.norm_k.eps,
                                 heads, *rotary_emb)
                return
        q = torch.empty((*x.shape[:2], heads, x.shape[2] // heads), dtype=x.dtype, device=x.device)
        if rotary_reason(q, rotary_emb) is None:
            rope_qk(q, q, *rotary_emb)

    @staticmethod
    def _precompile_norms(block: nn.Module, like: torch.Tensor, table: torch.Tensor, temb: torch.Tensor) -> None:
        """Record the fused LayerNorm variants the ``layer_norm`` chain launches (see :meth:`precompile`)."""
        layer_norm_modulate(like, block.norm1.eps, table, temb, 0, 1, out_dtype=like.dtype)
        norm2 = block.norm2
        if getattr(norm2, "weight", None) is not None:
            layer_norm(like, norm2.eps, norm2.weight, norm2.bias, out_dtype=like.dtype)

    def block_forward(self, block: nn.Module, counts: list[int], x: torch.Tensor,
                      encoder_hidden_states: torch.Tensor, temb: torch.Tensor, rotary_emb: Any,
                      full_table: torch.Tensor, norms: tuple[bool, bool, bool] = (False, False, False)) -> torch.Tensor:
        """The block's forward with fused pointwise chains (the checks of :meth:`make_block_forward` passed).

        ``counts`` are the block's plain counters (:class:`~worldfoundry_block_fusion.handle.BlockCounts`);
        ``norms`` says which of ``norm1``, ``norm2``, ``norm3`` run in the fused LayerNorm kernels. The float32
        stream ``xf`` is computed only where an eager operation reads it.
        """
        table = full_table[0]
        carry = self.carry_enabled and x.dtype != torch.float32
        hooks = not no_global_hooks()
        mods = None if (self.modulate and self.gate) else _eager_modulation(full_table, temb)
        xf = self.carry.take(x, block) if carry else None
        if xf is not None:
            counts[FLOAT_CARRY] += 1  # counted where a carried float32 stream replaces a .float() cast
        # 1. self-attention
        h, xf = self._modulated(block.norm1, norms[0], x, xf, table, temb, 0, 1, mods, counts, hooks)
        attn = block.attn1(h, None, None, rotary_emb)
        x, xf = self._gate(x, xf, attn, table, full_table, temb, 2, mods, carry, counts)
        # 2. cross-attention
        if norms[1]:
            norm2 = block.norm2
            h = layer_norm(x, norm2.eps, norm2.weight, norm2.bias, out_dtype=x.dtype)[0]
            counts[LAYER_NORM] += 1
        else:
            xf = x.float() if xf is None else xf
            h = fp32_layer_norm(block.norm2, xf, global_hooks=hooks).type_as(x)
        attn = cross_attention(block.attn2, h, encoder_hidden_states, global_hooks=hooks)
        if self.cross and attn.dtype == x.dtype and attn.shape == x.shape:
            x, xf = residual_add(x, attn, with_float=carry)
            counts[CROSS_RESIDUAL] += 1
            if carry:
                counts[FLOAT_CARRY] += 1
        else:
            x = x + attn
            xf = None
        # 3. feed-forward
        h, xf = self._modulated(block.norm3, norms[2], x, xf, table, temb, 3, 4, mods, counts, hooks)
        ff = feed_forward(block.ffn, h, global_hooks=hooks)
        consumer = self._next[id(block)] if carry else None
        # the last block writes the float32 stream too (unused): one compiled kernel variant fewer on first use
        x, xf = self._gate(x, xf, ff, table, full_table, temb, 5, mods, carry, counts)
        if consumer is not None and xf is not None:
            self.carry.put(x, xf, block, consumer)
        return x

    def _modulated(self, norm: nn.Module, fused: bool, x: torch.Tensor, xf: torch.Tensor | None,
                   table: torch.Tensor, temb: torch.Tensor, k_shift: int, k_scale: int,
                   mods: list[torch.Tensor] | None, counts: list[int],
                   global_hooks: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(norm(x.float()) * (1 + scale) + shift).type_as(x)`` and the float32 stream (computed if it ran)."""
        if fused:
            counts[LAYER_NORM] += 1
            counts[MODULATE] += 1
            return layer_norm_modulate(x, norm.eps, table, temb, k_shift, k_scale, out_dtype=x.dtype), xf
        if xf is None:
            xf = x.float()
        n = fp32_layer_norm(norm, xf, global_hooks=global_hooks)
        if self.modulate:
            counts[MODULATE] += 1
            return modulate(n, table, temb, k_shift, k_scale, out_dtype=x.dtype)[0], xf
        return (n * (1 + mods[k_scale]) + mods[k_shift]).type_as(x), xf

    def fused_norms(self, block: nn.Module, x: torch.Tensor, path: str) -> tuple[bool, bool, bool]:
        """Which of the block's three norms the ``layer_norm`` chain computes in this call; each that cannot is
        counted as a fallback with its reason (``norm1``/``norm3`` also need the ``modulate`` chain, and an
        ``nn.Identity`` ``norm2`` -- no cross-attention norm -- has nothing to fuse).

        The stream is checked once per call, each norm's static checks once per (norm, parameters, width) and
        remembered (:attr:`norms_checked`), its wrappers and hooks on every call.
        """
        stream = stream_norm_reason(x)
        n = x.shape[-1]
        global_hooks = not no_global_hooks()
        fused = []
        for norm, affine, with_mod in ((block.norm1, False, True), (block.norm2, True, False),
                                       (block.norm3, False, True)):
            if (with_mod and not self.modulate) or type(norm) is nn.Identity:
                fused.append(False)
                continue
            reason = stream or self._module_reason(norm, n, affine)
            if reason is None and norm_hooked(norm, global_hooks):
                reason = "layer_norm: the norm module is wrapped or hooked (it runs as a module)"
            if reason is not None:
                self.counters.fallback(path, reason)
            fused.append(reason is None)
        return fused[0], fused[1], fused[2]

    def _module_reason(self, norm: nn.Module, n: int, affine: bool) -> str | None:
        """:func:`~worldfoundry_block_fusion.eligibility.norm_module_reason`, remembered while the norm's
        parameters (objects and storage addresses) and the width stay the same."""
        params = norm._parameters
        weight, bias = params.get("weight"), params.get("bias")
        key = (n, affine, id(weight), 0 if weight is None else weight.data_ptr(), id(bias),
               0 if bias is None else bias.data_ptr())
        held = self.norms_checked.get(id(norm))
        if held is not None and held[1] == key:
            return None
        reason = norm_module_reason(norm, n, affine=affine)
        if reason is None:  # the objects are held, so their ids cannot be reused while the entry exists
            self.norms_checked[id(norm)] = ((norm, weight, bias), key)
        return reason

    def _gate(self, x: torch.Tensor, xf: torch.Tensor, y: torch.Tensor, table: torch.Tensor,
              full_table: torch.Tensor, temb: torch.Tensor, k: int, mods: list[torch.Tensor] | None, carry: bool,
              counts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x.float() + y.float() * gate).type_as(x)`` and, when carried, its float32 value."""
        if self.gate and y.shape == x.shape:
            # reads x (bfloat16), not its float32 copy: the same values, half the bytes
            out, carried = gated_residual(x, y, table, temb, k, with_float=carry)
            counts[GATED_RESIDUAL] += 1
            if carried is not None:
                if k != 5:  # the FFN gate's float32 output is counted when the next block uses it
                    counts[FLOAT_CARRY] += 1
                return out, carried
            return out, (out if out.dtype == torch.float32 else None)  # a float32 stream is its own float value
        if mods is None:
            mods = _eager_modulation(full_table, temb)
        out = ((x.float() if xf is None else xf) + y.float() * mods[k]).type_as(x)
        return out, None

    # ------------------------------------------------------------------ the self-attention processor
    def make_processor(self, original: Any, path: str) -> WanFusedSelfAttnProcessor:
        return WanFusedSelfAttnProcessor(original, self, path)


def _eager_modulation(table: torch.Tensor, temb: torch.Tensor) -> list[torch.Tensor]:
    """The six modulation tensors exactly as eager computes them."""
    if temb.ndim == 4:
        return [t.squeeze(2) for t in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    return list((table + temb.float()).chunk(6, dim=1))


class WanFusedSelfAttnProcessor:
    """``WanAttnProcessor`` for self-attention with the Q/K rotary embedding as one kernel launch.

    Everything else is the processor's own code path: ``_get_qkv_projections`` (so diffusers' or another plugin's
    fused projections apply), ``norm_q``/``norm_k``, ``dispatch_attention_fn`` with the processor's backend, and
    ``to_out``. Cross-attention calls (``encoder_hidden_states`` given) go to the original processor. Where
    diffusers' dispatcher would call PyTorch's SDPA directly, SDPA is called directly, and an identity dropout is
    not called (:mod:`~worldfoundry_block_fusion.direct_calls`).
    """

    #: where :meth:`__call__` looks up ``dispatch_attention_fn`` at call time (so a policy that wraps that global,
    #: such as ``attention_policy``'s dispatcher-only interception, sees these calls too)
    dispatch_namespace = transformer_wan

    def __init__(self, original: Any, runtime: WanBlockRuntime, path: str) -> None:
        self.original = original
        self.runtime = runtime
        self.path = path
        self.counts = runtime._counts[path]
        self.qk_check = QKNormCheck()
        self._attention_backend = getattr(original, "_attention_backend", None)
        self._parallel_config = getattr(original, "_parallel_config", None)

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if encoder_hidden_states is not None or attn.add_k_proj is not None or self.runtime.kernels.pending():
            # cross-attention, or kernels compiling in the background (the block's fallback counted it)
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        # looked up in diffusers' module at call time, as the stock processor resolves them (a patch there applies)
        global_hooks = not no_global_hooks()
        query, key, value = qkv_projections(transformer_wan._get_qkv_projections, attn, hidden_states,
                                            global_hooks=global_hooks)
        heads = attn.heads
        fused = (self._qk_norm_rope(attn, query, key, rotary_emb)
                 if rotary_emb is not None and self.runtime.qk_norm else None)
        if fused is not None:
            query, key = fused
        else:
            query = unflatten_view(rms_norm(attn.norm_q, query, global_hooks=global_hooks), 2, (heads, -1))
            key = unflatten_view(rms_norm(attn.norm_k, key, global_hooks=global_hooks), 2, (heads, -1))
            if rotary_emb is not None:
                query, key = self._rotary(query, key, rotary_emb)
        value = unflatten_view(value, 2, (heads, -1))
        dispatch = transformer_wan.dispatch_attention_fn
        if attention_mask is None:
            hidden_states = attention(dispatch, query, key, value, self._attention_backend, self._parallel_config)
        else:
            hidden_states = dispatch(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                     backend=self._attention_backend, parallel_config=self._parallel_config)
        hidden_states = hidden_states.flatten(2, 3)
        if hidden_states.dtype != query.dtype:  # ``type_as`` returns the tensor itself when the dtypes agree
            hidden_states = hidden_states.to(query.dtype)
        return output_projection(attn, hidden_states, global_hooks=global_hooks)

    def _qk_norm_rope(self, attn: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      rotary_emb: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``norm_q``/``norm_k`` and the rotary embedding as one launch (the ``qk_norm`` chain), or ``None`` after
        counting the fallback's reason (the caller then runs them as eager does)."""
        runtime = self.runtime
        if torch.is_grad_enabled():
            reason = REASON_GRAD
        elif query.dim() == 3 and query.shape[1] < runtime.min_tokens:
            reason = REASON_TOKENS
        else:
            reason = unavailable_reason(query) or self.qk_check.reason(attn, query, key, rotary_emb)
        if reason is not None:
            runtime.counters.fallback(self.path, reason if reason.startswith("qk_norm") else f"qk_norm: {reason}")
            return None
        counts = self.counts
        rid = current_request_id()
        if rid != counts.rid:
            runtime.counters.switch(counts, rid)
        counts.counts[QK_NORM] += 1
        counts.counts[ROPE] += 1
        norm_q, norm_k = attn.norm_q, attn.norm_k
        return rms_norm_rope_qk(query, key, norm_q.weight, norm_k.weight, norm_q.eps, norm_k.eps, attn.heads,
                                rotary_emb[0], rotary_emb[1])

    def _rotary(self, query: torch.Tensor, key: torch.Tensor, rotary_emb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        runtime = self.runtime
        checked = runtime.rotary_checked
        if torch.is_grad_enabled():
            reason = REASON_GRAD
        elif (checked is not None and type(rotary_emb) is tuple and len(rotary_emb) == 2
              and rotary_emb[0] is checked[0] and rotary_emb[1] is checked[1] and query.shape == checked[2]
              and key.shape == checked[2] and query.dtype == checked[3] and query.device == checked[4]):
            reason = unavailable_reason(query)  # the very (cos, sin) pair and Q/K geometry checked before
        else:
            reason = unavailable_reason(query) or rotary_reason(query, rotary_emb)
            if reason is None and key.shape != query.shape:
                reason = "key and query shapes differ"
            if reason is None and query.shape[1] < runtime.min_tokens:
                reason = REASON_TOKENS
            if reason is None and type(rotary_emb) is tuple:
                runtime.rotary_checked = (rotary_emb[0], rotary_emb[1], query.shape, query.dtype, query.device)
        if reason is None:
            counts = self.counts
            rid = current_request_id()
            if rid != counts.rid:
                runtime.counters.switch(counts, rid)
            counts.counts[ROPE] += 1
            return rope_qk(query, key, *rotary_emb)
        runtime.counters.fallback(self.path, f"rope: {reason}")
        return reference_rope(query, *rotary_emb), reference_rope(key, *rotary_emb)


__all__ = ["WanBlockRuntime", "WanFusedSelfAttnProcessor"]
