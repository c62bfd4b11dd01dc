"""Host-side shortcuts of the fused Wan block: the same operations with less Python around them.

A W17 forward of Wan2.1-1.3B is bound by the host (launches, module calls, the attention dispatcher), so the
fused forward also avoids Python work that computes nothing. Each shortcut applies only where it provably runs the
operations eager runs, and otherwise the module or function is called as usual:

* :func:`skips_dropout` -- an ``nn.Dropout`` that returns its input (evaluation mode or ``p == 0``: PyTorch's
  ``dropout`` returns the very input tensor then) and has no wrapper or hook of its own is not called.
* :func:`linear` -- a plain ``nn.Linear`` (that class exactly, no wrapper, no hook, no process-wide hook) is
  computed as its forward computes it, ``F.linear(x, weight, bias)``, without the module call around it. A Linear
  another plugin replaced or wrapped (FP8, SVDQuant, LoRA) is called as a module.
* :func:`qkv_projections` -- diffusers' ``_get_qkv_projections`` for unfused self-attention projections, with
  :func:`linear`; a patched ``_get_qkv_projections`` or fused projections run diffusers' function.
* :func:`rms_norm` -- a plain ``nn.RMSNorm`` is ``F.rms_norm(x, normalized_shape, weight, eps)``, its forward.
* :func:`cross_attention` -- the block's ``attn2`` call, where the module is diffusers' ``WanAttention`` with its
  stock ``WanAttnProcessor`` (that class exactly, no backend set on it), no image projections, no wrapper or hook:
  the processor's cross-attention steps in its order with the shortcuts above; anything else calls the module.
* :func:`fp32_layer_norm` -- diffusers' ``FP32LayerNorm`` on a float32 input with float32 (or no) affine
  parameters: its forward's ``.float()`` and ``.to(float32)`` return their inputs, so it is ``F.layer_norm`` itself.
* :func:`feed_forward` -- diffusers' ``FeedForward`` (class forward, no wrapper or hook) runs its ``net`` directly:
  identity dropouts are skipped, a plain diffusers ``GELU`` is its projection (:func:`linear`) and ``F.gelu``;
  any other feed-forward module is called.
* :func:`native_sdpa` -- ``dispatch_attention_fn`` with no backend given, PyTorch's native backend active and
  registered as diffusers ships it, no context parallelism, no mask and diffusers' argument checks off calls
  ``F.scaled_dot_product_attention`` on the ``[B, H, S, D]`` permutations exactly as diffusers' native backend does.
  When the dispatcher is wrapped or patched (e.g. by ``attention_policy``), the wrapper runs instead.

Example:
    >>> import torch.nn as nn
    >>> skips_dropout(nn.Dropout(0.1).eval(), global_hooks=False)
    True
    >>> skips_dropout(nn.Dropout(0.1).train(), global_hooks=False)
    False
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812


def skips_dropout(module: nn.Module, *, global_hooks: bool) -> bool:
    """Whether calling ``module`` would return its input unchanged and run nothing else."""
    return (type(module) is nn.Dropout and (not module.training or module.p == 0.0) and not global_hooks
            and not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__))


def _plain(module: nn.Module) -> bool:
    """No wrapper and no hook of its own: calling it runs its class's ``forward`` and nothing else."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in module.__dict__)


def linear(module: nn.Module, x: torch.Tensor, *, global_hooks: bool) -> torch.Tensor:
    """``module(x)``; for a plain ``nn.Linear`` its forward's own ``F.linear(x, weight, bias)`` (module docs)."""
    if type(module) is nn.Linear and not global_hooks and _plain(module):
        params = module._parameters
        return F.linear(x, params["weight"], params["bias"])
    return module(x)


def _original_qkv() -> Any:
    try:
        from diffusers.models.transformers import transformer_wan
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return None
    return transformer_wan._get_qkv_projections


#: diffusers' ``_get_qkv_projections`` as imported (before anything could patch it at run time)
_ORIGINAL_QKV: list[Any] = [_original_qkv()]


@functools.cache
def _diffusers_types() -> tuple[Any, Any, Any]:
    """(``FeedForward``, ``GELU``, the original ``transformer_wan._get_qkv_projections``)."""
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward

    return FeedForward, GELU, _ORIGINAL_QKV[0]


def qkv_projections(get_qkv: Any, attn: nn.Module, hidden_states: torch.Tensor, *,
                    global_hooks: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``get_qkv(attn, hidden_states, None)`` (self-attention), its three projections with :func:`linear` where
    ``get_qkv`` is diffusers' own and the projections are not fused."""
    if get_qkv is not _diffusers_types()[2] or attn.fused_projections:
        return get_qkv(attn, hidden_states, None)
    mods = attn._modules
    return (linear(mods["to_q"], hidden_states, global_hooks=global_hooks),
            linear(mods["to_k"], hidden_states, global_hooks=global_hooks),
            linear(mods["to_v"], hidden_states, global_hooks=global_hooks))


def rms_norm(norm: nn.Module, x: torch.Tensor, *, global_hooks: bool) -> torch.Tensor:
    """``norm(x)``; for a plain ``nn.RMSNorm`` its forward's own ``F.rms_norm``."""
    if type(norm) is nn.RMSNorm and not global_hooks and _plain(norm):
        return F.rms_norm(x, norm.normalized_shape, norm._parameters["weight"], norm.eps)
    return norm(x)


def attention(dispatch: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: Any,
              parallel_config: Any) -> torch.Tensor:
    """``dispatch(query, key, value, ...)`` as Wan's processor calls it (no mask), with :func:`native_sdpa`."""
    out = native_sdpa(dispatch, query, key, value, backend, parallel_config)
    if out is None:
        out = dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, backend=backend,
                       parallel_config=parallel_config)
    return out


def output_projection(attn: nn.Module, hidden_states: torch.Tensor, *, global_hooks: bool) -> torch.Tensor:
    """``attn.to_out[1](attn.to_out[0](hidden_states))`` with :func:`linear` and :func:`skips_dropout`."""
    to_out = attn.to_out
    if type(to_out) is nn.ModuleList:  # its items without ModuleList's index arithmetic
        out_proj, dropout = to_out._modules["0"], to_out._modules["1"]
    else:
        out_proj, dropout = to_out[0], to_out[1]
    hidden_states = linear(out_proj, hidden_states, global_hooks=global_hooks)
    if not skips_dropout(dropout, global_hooks=global_hooks):
        hidden_states = dropout(hidden_states)
    return hidden_states


@functools.cache
def _wan_types() -> tuple[type, type]:
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

    return WanAttention, WanAttnProcessor


def cross_attention(attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, *,
                    global_hooks: bool) -> torch.Tensor:
    """``attn(hidden_states, encoder_hidden_states, None, None)`` (module docs)."""
    from diffusers.models.transformers import transformer_wan

    attention_type, processor_type = _wan_types()
    processor = attn.processor
    if (type(attn) is not attention_type or type(processor) is not processor_type or global_hooks
            or not _plain(attn) or attn.add_k_proj is not None or processor._attention_backend is not None):
        return attn(hidden_states, encoder_hidden_states, None, None)
    get_qkv = transformer_wan._get_qkv_projections
    if get_qkv is not _ORIGINAL_QKV[0] or attn.fused_projections:
        query, key, value = get_qkv(attn, hidden_states, encoder_hidden_states)
    else:
        mods = attn._modules
        query = linear(mods["to_q"], hidden_states, global_hooks=False)
        key = linear(mods["to_k"], encoder_hidden_states, global_hooks=False)
        value = linear(mods["to_v"], encoder_hidden_states, global_hooks=False)
    query = rms_norm(attn.norm_q, query, global_hooks=False)
    key = rms_norm(attn.norm_k, key, global_hooks=False)
    heads = attn.heads
    query = unflatten_view(query, 2, (heads, -1))
    hidden_states = attention(transformer_wan.dispatch_attention_fn, query, unflatten_view(key, 2, (heads, -1)),
                              unflatten_view(value, 2, (heads, -1)), None, None)
    hidden_states = hidden_states.flatten(2, 3)
    if hidden_states.dtype != query.dtype:  # ``type_as`` returns the tensor itself when the dtypes agree
        hidden_states = hidden_states.to(query.dtype)
    return output_projection(attn, hidden_states, global_hooks=False)


#: ``Tensor.unflatten`` without its Python wrapper (named-tensor handling, unused here): the same view
unflatten_view = torch._C.TensorBase.unflatten


@functools.cache
def _fp32_layer_norm_type() -> type:
    from diffusers.models.normalization import FP32LayerNorm

    return FP32LayerNorm


def fp32_layer_norm(norm: nn.Module, x: torch.Tensor, *, global_hooks: bool) -> torch.Tensor:
    """``norm(x)``; for a plain diffusers ``FP32LayerNorm`` on float32 operands, ``F.layer_norm`` (module docs)."""
    if type(norm) is _fp32_layer_norm_type() and x.dtype == torch.float32 and not global_hooks and _plain(norm):
        params = norm._parameters
        weight, bias = params.get("weight"), params.get("bias")
        if (weight is None or weight.dtype == torch.float32) and (bias is None or bias.dtype == torch.float32):
            return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)
    return norm(x)


def feed_forward(ffn: nn.Module, hidden_states: torch.Tensor, *, global_hooks: bool) -> torch.Tensor:
    """``ffn(hidden_states)``, running diffusers' ``FeedForward.net`` directly where that is what the call does."""
    ff_type, gelu_type, _ = _diffusers_types()
    if type(ffn) is not ff_type or global_hooks or not _plain(ffn):
        return ffn(hidden_states)
    for module in ffn.net._modules.values():
        kind = type(module)
        if kind is gelu_type and _plain(module) and hidden_states.device.type != "mps":
            hidden_states = linear(module._modules["proj"], hidden_states, global_hooks=False)
            hidden_states = F.gelu(hidden_states, approximate=module.approximate)
        elif kind is nn.Linear:
            hidden_states = linear(module, hidden_states, global_hooks=False)
        elif not skips_dropout(module, global_hooks=False):
            hidden_states = module(hidden_states)
    return hidden_states


@functools.cache
def _native_dispatch() -> tuple[Any, Any, Any, Any] | None:
    """(diffusers' dispatch function, its registry, the native backend's name and function), or ``None``."""
    try:
        from diffusers.models import attention_dispatch as ad
    except ImportError:  # pragma: no cover
        return None
    registry = getattr(ad, "_AttentionBackendRegistry", None)
    name = getattr(getattr(ad, "AttentionBackendName", None), "NATIVE", None)
    fn = getattr(ad, "_native_attention", None)
    if registry is None or name is None or fn is None:
        return None
    return ad.dispatch_attention_fn, registry, name, fn


def native_sdpa(dispatch: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: Any,
                parallel_config: Any) -> torch.Tensor | None:
    """Attention as ``dispatch(query, key, value)`` computes it, when that is PyTorch's SDPA called directly
    (module docs); ``None`` where the dispatcher must run."""
    native = _native_dispatch()
    if native is None or dispatch is not native[0] or backend is not None or parallel_config is not None:
        return None
    _, registry, name, fn = native
    if (registry._active_backend != name or registry._checks_enabled
            or registry._backends.get(name) is not fn):
        return None
    out = F.scaled_dot_product_attention(query.permute(0, 2, 1, 3), key.permute(0, 2, 1, 3),
                                         value.permute(0, 2, 1, 3), attn_mask=None, dropout_p=0.0,
                                         is_causal=False, scale=None)
    return out.permute(0, 2, 1, 3)


__all__ = ["attention", "cross_attention", "feed_forward", "fp32_layer_norm", "linear", "native_sdpa", "output_projection",
           "qkv_projections", "rms_norm", "skips_dropout", "unflatten_view"]
