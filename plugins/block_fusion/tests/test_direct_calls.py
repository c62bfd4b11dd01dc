"""The fused Wan block's host shortcuts (:mod:`worldfoundry_block_fusion.direct_calls`): taken only where they run
what eager runs; every wrapper, hook, patched dispatcher or other backend is still called."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from diffusers.models import attention_dispatch
from diffusers.models.attention import FeedForward
from diffusers.models.transformers import transformer_wan

from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry_block_fusion.direct_calls import (
    cross_attention,
    feed_forward,
    fp32_layer_norm,
    linear,
    native_sdpa,
    qkv_projections,
    rms_norm,
    skips_dropout,
)

pytestmark = pytest.mark.usefixtures("kernels")


@pytest.fixture(autouse=True)
def _helpers(kit) -> None:  # noqa: ANN001
    globals().update(build_wan=kit.build_wan, wan_inputs=kit.wan_inputs, run=kit.run, make_registry=kit.make_registry)


def install(model):
    return install_diffusion_accelerations(model, {"wan_block_fusion": {}}, registry=make_registry())


def test_skips_only_identity_dropouts_without_hooks() -> None:
    assert skips_dropout(nn.Dropout(0.3).eval(), global_hooks=False)
    assert skips_dropout(nn.Dropout(0.0).train(), global_hooks=False)
    assert not skips_dropout(nn.Dropout(0.3).train(), global_hooks=False)
    assert not skips_dropout(nn.Dropout(0.3).eval(), global_hooks=True)
    hooked = nn.Dropout(0.0).eval()
    hooked.register_forward_pre_hook(lambda m, a: None)
    assert not skips_dropout(hooked, global_hooks=False)
    assert not skips_dropout(nn.Identity(), global_hooks=False)

    class MyDropout(nn.Dropout):
        pass

    assert not skips_dropout(MyDropout(0.0).eval(), global_hooks=False)


def test_feed_forward_runs_net_directly_and_calls_hooked_or_foreign_modules() -> None:
    torch.manual_seed(0)
    ff = FeedForward(16, mult=2, activation_fn="gelu-approximate", dropout=0.5).eval()
    x = torch.randn(2, 5, 16)
    assert torch.equal(feed_forward(ff, x, global_hooks=False), ff(x))
    seen = []
    handle = ff.net[1].register_forward_hook(lambda m, a, out: seen.append(1))
    feed_forward(ff, x, global_hooks=False)
    handle.remove()
    assert seen == [1]
    handle = ff.register_forward_hook(lambda m, a, out: out * 2)
    assert torch.equal(feed_forward(ff, x, global_hooks=False), ff(x))
    handle.remove()
    other = nn.Sequential(nn.Linear(16, 16))
    assert torch.equal(feed_forward(other, x, global_hooks=False), other(x))


def test_native_sdpa_equals_the_dispatcher_and_yields_to_any_other_route() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 7, 2, 8) for _ in range(3))
    dispatch = attention_dispatch.dispatch_attention_fn
    direct = native_sdpa(dispatch, q, k, v, None, None)
    assert direct is not None and torch.equal(direct, dispatch(q, k, v))
    assert direct.stride() == dispatch(q, k, v).stride()
    assert native_sdpa(lambda *a, **kw: None, q, k, v, None, None) is None  # a wrapped or patched dispatcher
    assert native_sdpa(dispatch, q, k, v, "native", None) is None  # a backend named by the processor
    assert native_sdpa(dispatch, q, k, v, None, object()) is None  # context parallelism
    with attention_dispatch.attention_backend("_native_math"):
        assert native_sdpa(dispatch, q, k, v, None, None) is None


def test_fused_forward_calls_a_patched_dispatcher_and_hooked_dropouts(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_wan()
    inputs = wan_inputs()
    session = install(model)
    dense_fused = run(model, inputs, "r0")
    calls = []
    original = transformer_wan.dispatch_attention_fn

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", counting)
    hooked = []
    handles = [model.blocks[0].attn1.to_out[1].register_forward_hook(lambda m, a, out: hooked.append("attn")),
               model.blocks[0].ffn.net[1].register_forward_hook(lambda m, a, out: hooked.append("ffn"))]
    out = run(model, inputs, "r1")
    for handle in handles:
        handle.remove()
    session.uninstall()
    blocks = len(model.blocks)
    assert len(calls) == 2 * blocks  # self-attention (fused processor) and cross-attention (stock processor)
    assert sorted(hooked) == ["attn", "ffn"]
    assert torch.equal(out, dense_fused)
    assert torch.equal(run(model, inputs), dense_fused)


def test_linear_is_the_modules_own_computation_and_calls_anything_else() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    assert torch.equal(linear(lin, x, global_hooks=False), lin(x))
    no_bias = nn.Linear(8, 4, bias=False)
    assert torch.equal(linear(no_bias, x, global_hooks=False), no_bias(x))
    lin.forward = lambda t: t[:, :4] * 0  # a wrapper put on the instance runs
    assert torch.equal(linear(lin, x, global_hooks=False), torch.zeros(3, 4))
    del lin.forward
    handle = lin.register_forward_hook(lambda m, a, out: out + 1)
    assert torch.equal(linear(lin, x, global_hooks=False), lin(x))
    handle.remove()

    class MyLinear(nn.Linear):
        def forward(self, t):
            return super().forward(t) * 2

    mine = MyLinear(8, 4)
    assert torch.equal(linear(mine, x, global_hooks=False), mine(x))


def test_qkv_projections_use_diffusers_function_when_patched_or_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_wan()
    attn = model.blocks[0].attn1
    x = torch.randn(1, 6, attn.to_q.in_features, dtype=attn.to_q.weight.dtype, device=attn.to_q.weight.device)
    expected = transformer_wan._get_qkv_projections(attn, x, None)
    got = qkv_projections(transformer_wan._get_qkv_projections, attn, x, global_hooks=False)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    calls = []

    def patched(a, h, e):
        calls.append(1)
        return expected

    assert qkv_projections(patched, attn, x, global_hooks=False) is expected and calls == [1]
    monkeypatch.setattr(attn, "fused_projections", True)
    monkeypatch.setattr(attn, "to_qkv", nn.Identity(), raising=False)
    out = qkv_projections(transformer_wan._get_qkv_projections, attn, torch.cat([x, x, x], dim=-1),
                          global_hooks=False)
    assert torch.equal(out[0], x)  # diffusers' fused path ran (to_qkv, then chunk)


def test_fused_forward_runs_hooks_on_projections_and_the_ffn_and_stays_bitwise() -> None:
    model = build_wan()
    inputs = wan_inputs()
    session = install(model)
    fused = run(model, inputs, "r0")
    block = model.blocks[0]
    seen = []
    handles = [m.register_forward_hook(lambda m, a, out, name=name: seen.append(name))
               for name, m in (("to_q", block.attn1.to_q), ("to_out", block.attn1.to_out[0]),
                               ("gelu", block.ffn.net[0]), ("proj", block.ffn.net[0].proj),
                               ("down", block.ffn.net[2]))]
    out = run(model, inputs, "r1")
    for handle in handles:
        handle.remove()
    session.uninstall()
    assert sorted(seen) == ["down", "gelu", "proj", "to_out", "to_q"]
    assert torch.equal(out, fused)


def test_fp32_layer_norm_is_f_layer_norm_only_for_float32_operands_without_hooks() -> None:
    from diffusers.models.normalization import FP32LayerNorm

    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    for norm in (FP32LayerNorm(16, elementwise_affine=False, eps=1e-6), FP32LayerNorm(16, eps=1e-6)):
        assert torch.equal(fp32_layer_norm(norm, x, global_hooks=False), norm(x))
        xb = x.bfloat16()
        assert torch.equal(fp32_layer_norm(norm, xb, global_hooks=False), norm(xb))  # module path: bf16 out
        assert fp32_layer_norm(norm, xb, global_hooks=False).dtype == torch.bfloat16
    norm = FP32LayerNorm(16, eps=1e-6)
    handle = norm.register_forward_hook(lambda m, a, out: out * 0)
    assert torch.equal(fp32_layer_norm(norm, x, global_hooks=False), torch.zeros(2, 5, 16))
    handle.remove()
    plain = nn.LayerNorm(16)
    assert torch.equal(fp32_layer_norm(plain, x, global_hooks=False), plain(x))


def test_rms_norm_is_the_modules_own_computation() -> None:
    torch.manual_seed(0)
    norm = nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 16)
    assert torch.equal(rms_norm(norm, x, global_hooks=False), norm(x))
    handle = norm.register_forward_hook(lambda m, a, out: out * 0)
    assert torch.equal(rms_norm(norm, x, global_hooks=False), torch.zeros_like(x))
    handle.remove()
    assert torch.equal(rms_norm(nn.Identity(), x, global_hooks=False), x)


def _cross_inputs(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    w = attn.to_q.weight
    torch.manual_seed(3)
    return (torch.randn(1, 9, attn.to_q.in_features, dtype=w.dtype, device=w.device),
            torch.randn(1, 5, attn.to_k.in_features, dtype=w.dtype, device=w.device))


def test_cross_attention_equals_the_module_call_and_defers_to_anything_else() -> None:
    model = build_wan()
    attn = model.blocks[0].attn2
    h, e = _cross_inputs(attn)
    expected = attn(h, e, None, None)
    assert torch.equal(cross_attention(attn, h, e, global_hooks=False), expected)
    seen = []
    handle = attn.to_k.register_forward_hook(lambda m, a, out: seen.append("to_k"))
    assert torch.equal(cross_attention(attn, h, e, global_hooks=False), expected)
    handle.remove()
    handle = attn.register_forward_hook(lambda m, a, out: seen.append("attn2") or out * 0)
    assert torch.equal(cross_attention(attn, h, e, global_hooks=False), torch.zeros_like(expected))
    handle.remove()
    assert seen == ["to_k", "attn2"]

    class OtherProcessor(transformer_wan.WanAttnProcessor):
        def __call__(self, *args, **kwargs):
            seen.append("processor")
            return super().__call__(*args, **kwargs)

    original = attn.processor
    attn.set_processor(OtherProcessor())
    try:
        assert torch.equal(cross_attention(attn, h, e, global_hooks=False), expected)
    finally:
        attn.set_processor(original)
    assert seen[-1] == "processor"
